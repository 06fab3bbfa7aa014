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


def slurm_script(target: str, nodes: int = 1, gpus_per_node: int = 8, job_name: str = "") -> str:
    """An sbatch script: one task per node, each running torchrun over the node's GPUs,
    the first node of the allocation as the rendezvous endpoint."""
    name = job_name or target.rsplit("/", 1)[-1].rsplit(".", 1)[0] or "train"
    return f"""#!/bin/bash
# Written by fsdp2-retrofit for {target}. Submit with: sbatch <this file> [script arguments]
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --output=%x-%j.out
set -euo pipefail

# torchrun starts one process per GPU on each node; the nodes meet at the first node.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}

srun torchrun \\
    --nnodes="$SLURM_NNODES" \\
    --nproc_per_node={gpus_per_node} \\
    --rdzv_id="$SLURM_JOB_ID" \\
    --rdzv_backend=c10d \\
    --rdzv_endpoint="$head_node:{RDZV_PORT}" \\
    {shlex.quote(target)} "$@"
"""
