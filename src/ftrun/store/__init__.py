"""The store clients: how an agent reaches the job's key-value store, and nothing about what it
keeps there (that is `ftrun.rendezvous`). `connect` opens the c10d TCPStore (served by an agent
or by `ftrun store`) or etcd; `reconnecting` rides out a store's restart; `etcd_store` is the
etcd backend behind torch's `Store` interface (`etcd_wire`: its gateway's wire format)."""
