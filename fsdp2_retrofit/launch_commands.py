"""How to launch a rewritten script: torchrun on one node, on several, and under SLURM."""
from __future__ import annotations

import shlex

NPROC = "<gpus>"
RDZV_PORT = 29500


def single_node(target: str) -> str:
    """Every GPU of one machine."""
    return f"torchrun --nproc_per_node={NPROC} {shlex.quote(target)}"


def multi_node(target: str) -> str:
    """The same command on each node; the nodes meet at a rendezvous endpoint on one of them."""
    return (
        f"torchrun --nnodes=<nodes> --nproc_per_node={NPROC} --rdzv_backend=c10d "
        f"--rdzv_endpoint=<head-node>:{RDZV_PORT} --rdzv_id=<job-id> {shlex.quote(target)}"
    )


def slurm_script(target: str, nodes: int = 1, gpus_per_node: int = 8, job_name: str = "",
                 cpus_per_gpu: int = 8) -> str:
    """An sbatch script: one task per node, each running torchrun over the node's GPUs,
    the first node of the allocation as the rendezvous endpoint. The GPU count is written
    once, in `#SBATCH --gpus-per-node`; torchrun reads it back from SLURM_GPUS_ON_NODE. The
    node's one task gets the CPUs of all its processes (`--cpus-per-task`), handed to srun
    too (srun does not inherit sbatch's --cpus-per-task since Slurm 22.05)."""
    name = job_name or target.rsplit("/", 1)[-1].rsplit(".", 1)[0] or "train"
    return f"""#!/bin/bash
# Written by fsdp2-retrofit for {target}. Submit with: sbatch <this file> [script arguments]
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
# CPUs for each node's one task: torchrun and its process per GPU ({cpus_per_gpu} each)
#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}
#SBATCH --output=%x-%j.out
set -euo pipefail

# torchrun starts one process per GPU on each node (the --gpus-per-node above, as
# Slurm allocated it); the nodes meet at the first node.
gpus_per_node="${{SLURM_GPUS_ON_NODE:?no GPUs allocated: set #SBATCH --gpus-per-node}}"
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}

srun --cpus-per-task="${{SLURM_CPUS_PER_TASK:?set #SBATCH --cpus-per-task}}" torchrun \\
    --nnodes="$SLURM_NNODES" \\
    --nproc_per_node="$gpus_per_node" \\
    --rdzv_id="$SLURM_JOB_ID" \\
    --rdzv_backend=c10d \\
    --rdzv_endpoint="$head_node:{RDZV_PORT}" \\
    {shlex.quote(target)} "$@"
"""
