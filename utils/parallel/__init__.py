"""Where arrays live: the device mesh and multi-process start (mesh.py) and each
parameter's and state leaf's sharding (layout.py).
"""
