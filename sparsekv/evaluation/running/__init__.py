"""Running an evaluation grid: planning its samples and runs, executing them on a model, and the decode-heavy grid."""
