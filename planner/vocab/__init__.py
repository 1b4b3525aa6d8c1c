"""The plan vocabulary: what the planner writes and the runtime reads. Placements and their string
form, strategies and a stage's per-node program, the gradient placement rules, the DTensor rules
both sides register, and the plan file.
"""
