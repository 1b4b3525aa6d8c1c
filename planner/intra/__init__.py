"""The intra-operator pass: DTensor strategies of every op, their prices, the cost graph's reductions
and the ILP that picks one strategy per node for a stage on a logical mesh.
"""
