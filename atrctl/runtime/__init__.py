"""The process's place in the world: its rank under torchrun, its CPUs and memory, and the allocator's settings."""
