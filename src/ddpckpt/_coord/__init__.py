"""Coordination between ranks: store collectives, liveness, topology, who writes what, replication checks."""
