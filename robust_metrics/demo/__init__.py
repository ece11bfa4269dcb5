"""`robust-metrics demo`: a real training job on this machine, watched by robust-metrics."""
