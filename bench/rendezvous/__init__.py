"""The rendezvous and its stores."""
