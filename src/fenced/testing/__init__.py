"""Test kit shipped with fenced: real servers on loopback, and paused or killed client processes.

``fenced.testing.servers`` starts etcd, ZooKeeper, Redis and PostgreSQL on 127.0.0.1 with a
free port and a temporary directory, and can stop, kill, pause and restart them on the same
data, which is what the fault tests of fenced (and of your code) need.
"""
