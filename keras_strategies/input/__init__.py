"""Input for distributed training: contexts and options, batch splitting, distributed datasets."""
