"""The expert rebalancer: follows the MoE expert loads workers publish on NATS and publishes expert placements.

`rebalancer.ExpertRebalancer` is the pure logic (a moving window of loads per model, plans from mesh.eplb);
`server.py` wires it to NATS (loads in, plans out), gRPC (GetPlan) and metrics.
"""
