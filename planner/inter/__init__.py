"""The inter-operator pass: layer clustering, the stage cost table, the stage DP and the search over
submeshes, logical meshes and micro-batch counts.
"""
