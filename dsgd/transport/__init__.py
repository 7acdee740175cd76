"""How bytes move between a worker and a server, with no TensorFlow: the ends of each pair (``ends``) over shared memory, signal channels, TCP streams or the object store."""
