"""Runtime: processes, meshes, shardings, pipeline schedules, training steps and the device profiler."""
