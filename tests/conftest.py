"""Test-wide settings."""

import torch

# The models under test are tiny: one thread is faster than two, and CI's two cores are shared with other
# processes, where OpenMP threads oversubscribing them made the suite ten times slower.
torch.set_num_threads(1)
