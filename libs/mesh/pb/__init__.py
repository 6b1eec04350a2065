"""Generated from proto/kvmesh/v1 by `python -m mesh.protogen`. Do not edit."""
