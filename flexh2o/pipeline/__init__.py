"""Pipeline stages over torch.distributed: the stage split, the ring of hidden states, launch by torchrun."""
