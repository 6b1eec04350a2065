"""The roles of the mesh, each a thin process around a core object."""
