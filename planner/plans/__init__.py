"""Plans made from search results or from a manual (Megatron-style) configuration: typed assembly
into a `ParallelPlan`, and the manual configurations.
"""
