"""The data plane: tensors staged in a role's buffer pool and pulled by the next role over a transfer engine (shared
memory, TCP, Mooncake, CUDA IPC), and the choice of engine for a pair of pools."""
