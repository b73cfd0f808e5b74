"""The request plane: from a parsed request to the vectors it is answered with, torch-free.

Everything here runs in every ``--api-workers`` front-end and in the engine process alike; the
device plane (:mod:`embedding_server.device`) is the other side of the torch wall.
"""
