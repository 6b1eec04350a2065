"""kvmesh's command line (`kvmesh ...`) and benchmarks (`kvmesh bench ...`)."""
