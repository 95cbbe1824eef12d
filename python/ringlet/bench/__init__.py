"""ringlet's benchmarks, one entry point: ``python -m ringlet.bench <what>``.

Each compares ringlet with the tool a user would otherwise pick, side by side
in the same processes, alternating, and prints Markdown tables of medians:

* ``collectives``: ringlet's collectives vs gloo, or Open MPI with
  ``--against mpi`` (under ``mpirun``; needs the ``bench`` extra's mpi4py);
* ``fronts``: a small all_reduce through each front end (torch_xla-style,
  ``torch.ops.ringlet``, torch.distributed) and the peer, alternating;
* ``c10d``: the torch.distributed API on a ringlet group vs a gloo group, and
  torch DDP / FSDP2 training steps;
* ``ddp``: ringlet's DistributedDataParallel vs torch DDP;
* ``optimizer``: ``optimizer_step`` with many small gradients;
* ``checkpoint``: sharded checkpoint save/load vs torch.save/torch.load;
* ``rpc``: ringlet.rpc vs torch.distributed.rpc;
* ``dtypes``: all_reduce GB/s by element type (float32 vs bfloat16/float16);
* ``cuda``: the tensor API's bucket all-reduce of CUDA vs host gradients;
* ``hosts``: every collective across hosts made of network namespaces (tbf
  rate-limited links) vs gloo, with each op's link limit (needs root;
  :mod:`ringlet.bench.netns` makes the hosts);
* ``algorithms``: what each of Bagua's algorithms buys across such hosts:
  training steps and time to accuracy against torch DDP on gloo and
  ringlet, fp16 and PowerSGD hooks (needs root);
* ``replicas``: what a replica lost in the middle of a DiLoCo sync costs the
  survivors (they finish the sync among themselves and go on);
* ``scale``: start-up, a new group, sockets, store operations and small
  all_reduces as the rank count grows, each rank its own logical host, vs gloo.

``--plot FILE`` (where a benchmark offers it) draws the table as a PNG.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench collectives --budget 2
  mpirun -np 2 python -m ringlet.bench collectives --against mpi
  torchrun --nproc_per_node 2 -m ringlet.bench c10d
  sudo python -m ringlet.bench hosts --layout 2,2 --rate 2gbit
  sudo python -m ringlet.bench algorithms --layout 2,2 --rate 1gbit
"""

WHAT = ("collectives", "fronts", "c10d", "ddp", "optimizer", "checkpoint", "rpc", "dtypes", "cuda",
        "hosts", "model", "algorithms", "scale", "replicas")
