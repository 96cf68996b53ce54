"""What a fused lookup needs to know besides its tensors, as a few typed records.

A module builds its ``LookupPlan`` once (tables, features, widths) and hands it, with the
batch's tensors, to the lookup; only ``pooled_embedding_forward`` (a torch.library op, whose
schema allows no records) takes the fields one by one. The records are ``NamedTuple``s: fx
records them as literal arguments, TorchScript and torch.compile read them as typed tuples.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch


class GroupPlan(NamedTuple):
    """One group of tables (one weight dtype, one flat buffer, one kernel launch)."""

    features: List[str]  # KJT key of each pooled output, in the group's output order
    tables: List[str]  # the table each of those reads (for error messages)
    total_dim: int  # output columns of the group
    max_dim: int  # widest table
    num_rows: int  # rows of all the group's tables (the backward's row keys are 32-bit when they fit)
    # layout.table_runs: how the flat gradient splits into the tables' gradients
    table_runs: List[Tuple[int, int, int, List[int]]]


class LookupPlan(NamedTuple):
    """Every group of a module, plus the settings the lookup runs with."""

    groups: List[GroupPlan]
    is_weighted: bool
    backend: str
    validate: bool
    report_id: int  # where the GPU kernels' input reports go (input_check.new_report_id)
    output_features: List[str]  # the output's features in column order (variable batches' gather)
    output_dims: List[int]  # their widths


class FusedStep(NamedTuple):
    """The optimizer fused into the backward (``optim.spec``): its kind, each group's state
    tensors, and the hyper-parameter and step tensors the kernels read."""

    kind: int
    states: List[List[torch.Tensor]]  # per group: 0 to 2 state tensors
    state1_is_row: bool  # first state is one value per row (row-wise Adagrad)
    hyper: torch.Tensor
    step: torch.Tensor
    # this forward's count of ``step`` left to the first group's lookup, which folds it into its
    # kernel's launch (the EmbeddingCollection's: a launch of its own cost a host-bound step ~25 us)
    count_in_lookup: bool


def group_states(fused: Optional[FusedStep], group: int) -> List[Optional[torch.Tensor]]:
    """The group's two optimizer-state slots (None where the optimizer keeps fewer)."""
    if fused is None:
        return [None, None]
    states = fused.states[group]
    first: Optional[torch.Tensor] = states[0] if len(states) > 0 else None
    second: Optional[torch.Tensor] = states[1] if len(states) > 1 else None
    return [first, second]


class UnpooledGroupPlan(NamedTuple):
    """One group of an EmbeddingCollection (one weight dtype, one flat buffer, one launch)."""

    features: List[str]  # KJT key of each output, in the group's output order
    tables: List[str]  # the table each of those reads
    embedding_names: List[str]  # each output's key in the module's output (``feature@table`` when shared)
    names: str  # validation.encode_names of them (an input error's names)
    num_rows: int  # rows of all the group's tables


class UnpooledPlan(NamedTuple):
    """Every group of an EmbeddingCollection, plus the settings its lookup runs with."""

    groups: List[UnpooledGroupPlan]
    order: List[Tuple[int, int]]  # the outputs in torchrec's order (tables, then features): (group, index)
    dim: int  # the tables' common embedding dim
    need_indices: bool  # each output JaggedTensor carries its ids as weights
    backend: str
    validate: bool
    report_id: int  # input_check.new_report_id
