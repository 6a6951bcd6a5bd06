"""The machine and what things cost on it: devices, clusters, collectives, op compute time, model-state memory, measured op times, failures."""
