"""Config: where things live (paths, the ws.* resolvers) and typed views of the resolved Hydra config.

Imports nothing else from the workspace; every other package may import it.
"""
