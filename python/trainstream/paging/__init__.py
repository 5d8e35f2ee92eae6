"""Weight paging: the weights of a model bigger than the GPU live in the job's host memory and come to the
GPU block by block (`wrap(param_offload=...)`).

blocks.py    which weights page: the model's block stack, the share of it param_offload selects (PagingPlan)
pager.py     the run time: BlockPager loads and evicts blocks around their forward and backward
host_pins.py page-locking this process's view of the paged host memory, in the background

Invariant: a paged weight is read by the model only while its block is in its GPU slot.
"""
