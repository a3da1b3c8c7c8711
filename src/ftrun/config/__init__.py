"""Every component's configuration, one frozen dataclass each (`agent`, `monitor`,
`rendezvous`, `store`, `straggler`, `observe`), and the tree of them the launcher builds
(`launch.LaunchConfig`). Data only: every package reads its own from here, and nothing here
imports a package that reads it."""
