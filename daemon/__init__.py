"""The daemon: reads all rings, reassembles per request, serves subscribers over ZeroMQ."""
