"""GIFT in torchft's DiLoCo: each fragment's pseudo-gradient all-reduce through GIFT's codec.

    from horovod_gift.integrations.torchft import GiftDiLoCo
    manager = Manager(pg=ProcessGroupGloo(), use_async_quorum=False, ...)
    with GiftDiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=100,
                    format="nvfp4") as diloco:     # the default; "int3" from 4 replica groups
        for batch in data:          # the loop of torchft's DiLoCo, unchanged
            loss = model(batch).backward(); inner_optimizer.step(); inner_optimizer.zero_grad()

GiftDiLoCo is torchft.local_sgd.DiLoCo (its outer loop, fragments, quorum, recovery, commit)
with one change: where a fragment's pseudo-gradients were all-reduced in fp32 (or FP8 without
error feedback), they go through GIFT's reduction over the manager's process group: transformed,
quantized with error feedback, summed in fp32 by each chunk's owner, divided by the
participants, and the same bits on every replica. torchft's rules stay:
- a collective that fails is reported to the manager (later ones are skipped), the fragment's
  pseudo-gradients are zeroed, should_commit() fails everywhere and the outer step is discarded;
  GIFT's residuals roll back with it (core/pseudo_gradients.py: they change only on a commit);
  with two hops, a collective across replicas that fails on one rank of a replica group fails
  the sync on every rank of the group (they agree before and after it), so none waits;
- a replica that does not participate (healing) sends zeros, without its residuals;
- a non-finite average (the same on every replica) discards the outer step the same way
  (nonfinite="nan"), or raises on every replica (nonfinite="raise");
- the manager's state goes to a healing replica through register_state_dict_fn: GIFT sends its
  options only, and the healing replica restarts its residuals at zero (they are the error of
  another replica's quantization, and would cross the slow link at 4 bytes a parameter);
- a user's checkpoint keeps each rank's residuals (GiftDiLoCo.state_dict / load_state_dict);
  when the replicas or this one's rank differ at the next sync, r2 is folded into r1.

Two hops: when the ranks of a replica group hold the same parameters (DDP inside the group;
`group=`: their process group, by default torch.distributed's default group), each rank sends
1/L of the pseudo-gradient across replicas (reduce/two_hop.py, the replica group as the node).
Give that group a longer timeout than the manager's: where a collective across replicas fails
on one rank, its group peers wait for it inside the group while it waits out its own timeout.
Under FSDP2 inside the group each rank's local shard is already 1/L: the reduction is flat.
"""
from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torchft.local_sgd import DiLoCo

from ..codec.tensor_codec import Codec
from ..config import GiftConfig, numeric_options
from ..core.pseudo_gradients import PseudoGradientState, failed_locals
from ..reduce.communicator import StopAtFirstError
from ..reduce.topology import Flat, TwoHop
from ..torch_comm import ProcessGroupCommunicator, TorchCommunicator
from . import torchft_internals as internals

if TYPE_CHECKING:
    from torchft.manager import Manager

logger = logging.getLogger("horovod_gift")

# DiLoCo's options that GIFT's reduction replaces, and what to use instead
REPLACED = {"should_quantize": "GIFT quantizes (format=)",
            "use_bucketization": "GIFT buckets the pseudo-gradients (bucket_elements=)",
            "bucket_cap_mb": "GIFT buckets the pseudo-gradients (bucket_elements=)"}
# the options a healing replica must share with the replica it heals from
SHARED_OPTIONS = (*numeric_options(), "bucket_elements", "hadamard_block", "topology",
                  "nonfinite")


class GiftDiLoCo(DiLoCo):
    """torchft's DiLoCo (same arguments) whose outer all-reduce is GIFT's. group: the process
    group of the ranks inside a replica group that hold identical parameters (two hops; None:
    the default group when one is initialized; its timeout longer than the manager's);
    config / options: GiftConfig's fields, with
    DiLoCo's defaults (GiftConfig.for_diloco)."""

    def __init__(self, manager: Manager, model_fragments: list[torch.nn.Module],
                 inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                 sync_every: int, *, group: Optional[dist.ProcessGroup] = None,
                 config: Optional[GiftConfig] = None, **options) -> None:
        diloco_options = {k: options.pop(k) for k in list(options)
                          if k in ("backup_device", "pin_memory", "fragment_sync_delay",
                                   "fragment_update_alpha", *REPLACED)}
        for name, instead in REPLACED.items():
            if diloco_options.get(name):
                raise ValueError(f"GiftDiLoCo: {name}={diloco_options[name]!r} does not apply: "
                                 f"{instead}")
        self.config = GiftConfig.of(config, GiftConfig.for_diloco, options)
        self.config.refuse_for_diloco()
        _check_outer_optimizers(model_fragments, outer_optimizer)
        super().__init__(manager, model_fragments, inner_optimizer, outer_optimizer,
                         sync_every, **diloco_options)
        node = self._node_communicator(group, model_fragments, manager)
        self.syncs = [FragmentSync(fragment, manager, self.config, node)
                      for fragment in internals.fragments(self)]

    def _node_communicator(self, group, model_fragments, manager):
        """The communicator of the replica group's ranks for two hops, or None (flat)."""
        topology = self.config.topology
        if topology == "flat":
            return None
        given = group is not None
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        ranks = dist.get_world_size(group) if group is not None else 1
        sharded = [name for module in model_fragments for name, p in module.named_parameters()
                   if isinstance(p, DTensor)
                   and any(not isinstance(pl, Replicate) for pl in p.placements)]
        if ranks == 1:
            why = "the replica group has one rank"
        elif sharded:
            why = f"{sharded[0]} is sharded inside the replica group: each rank's shard is " \
                  "already 1/L of it"
        elif not given and ranks != internals.group_world_size(manager):
            why = (f"the default process group has {ranks} ranks and the replica group "
                   f"{internals.group_world_size(manager)}: pass group= (the ranks holding the "
                   "same weights)")
        else:
            why = None
        if why is None:
            return TorchCommunicator(group)
        if topology == "two-hop":
            raise ValueError(f"GiftDiLoCo: topology='two-hop' needs ranks that hold the same "
                             f"parameters inside a replica group: {why}")
        return None

    def state_dict(self) -> dict:
        """This rank's GIFT state, to save beside the user's checkpoint (one file a rank)."""
        return {"config": shared_options(self.config),
                "fragments": [sync.state.state_dict() for sync in self.syncs]}

    def load_state_dict(self, state: dict) -> None:
        check_options(self.config, state["config"], "the checkpoint")
        if len(state["fragments"]) != len(self.syncs):
            raise ValueError(f"GiftDiLoCo: the checkpoint has {len(state['fragments'])} "
                             f"fragments, this DiLoCo {len(self.syncs)}")
        for sync, fragment_state in zip(self.syncs, state["fragments"]):
            sync.state.load_state_dict(fragment_state)

    def stats(self) -> dict:
        """Bytes sent by this rank in the last sync of each fragment, and residual bytes."""
        return {"bytes_sent": [sync.bytes_sent for sync in self.syncs],
                "residual_bytes": sum(sync.state.residual_bytes() for sync in self.syncs)}


def _check_outer_optimizers(model_fragments, outer_optimizer):
    """torchft steps a fragment's outer optimizer at that fragment's sync: one optimizer over
    several fragments would also move the other fragments' parameters, by their inner
    gradients (measured: Streaming DiLoCo on the example Llama diverged from step 500)."""
    if len(model_fragments) == 1:
        return
    if not isinstance(outer_optimizer, (list, tuple)):
        raise ValueError(f"GiftDiLoCo: one outer_optimizer for {len(model_fragments)} "
                         "fragments would step every fragment's parameters at each fragment's "
                         "sync; pass a list, one optimizer a fragment over its parameters")
    for k, (fragment, optimizer) in enumerate(zip(model_fragments, outer_optimizer)):
        mine = {id(p) for p in fragment.parameters()}
        theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if theirs != mine:
            raise ValueError(f"GiftDiLoCo: outer_optimizer[{k}] does not hold exactly the "
                             f"parameters of model_fragments[{k}]; pass one optimizer a "
                             "fragment over its parameters")


def shared_options(config):
    """The options every replica must share, by name."""
    return {k: getattr(config, k) for k in SHARED_OPTIONS}


def check_options(config, options, where):
    for name, value in options.items():
        if getattr(config, name) != value:
            raise ValueError(f"GiftDiLoCo: {name} is {getattr(config, name)!r} here and "
                             f"{value!r} in {where}; pass the same on every replica")


class RankNumbering:
    """Every rank of every replica group numbered as one (replica r, group rank l: r * L + l),
    as a two-hop topology names ranks; no process group spans them."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


class FragmentSync:
    """One fragment's outer all-reduce through GIFT: the pseudo-gradients' state, torchft's
    _average_grads replaced, its perform_sync followed by a commit or a rollback."""

    def __init__(self, fragment, manager, config, node):
        self.fragment, self.manager, self.config, self.node = fragment, manager, config, node
        self.index = internals.fragment_id(fragment)
        tensors = {name: p.to_local() if isinstance(p, DTensor) else p
                   for name, p in internals.fragment_module(fragment).named_parameters()}
        # a two-hop bucket needs a chunk for every rank of the replica group
        self.state = PseudoGradientState(
            tensors, config, key=self.index,
            min_bucket=node.size * Codec(config.format, config.block_size).align if node else 0)
        # what _fingerprints sends, made once: the options, the replica group's size, the sizes
        values = [*shared_options(config).values(), node.size if node is not None else 1,
                  tuple(self.state.sizes.items())]
        self.fingerprint = [zlib.crc32(repr(v).encode()) for v in values]
        # the last sync's: bytes this rank sent, those of them across replicas (quantized), and
        # its topology in words
        self.bytes_sent, self.cross_bytes, self.described = 0, 0, None
        internals.replace_average(fragment, self.average)
        internals.wrap_perform_sync(fragment, self.settle)
        manager.register_state_dict_fn(f"GiftDiLoCo_{self.index}", self.load_from_peer,
                                       self.options)

    def options(self):
        return shared_options(self.config)

    def load_from_peer(self, options):
        """A healing replica: residuals restart at zero. Options that differ from the peer's are
        not refused here (only this replica would raise, its peers would wait for it): the next
        sync's agreement check raises on every replica."""
        self.state.reset()
        logger.info("GIFT: fragment %d heals from a peer: its residuals restart at zero",
                    self.index)

    def _topology(self, cross, node):
        if node is None:
            return Flat(cross)
        ranks = RankNumbering(cross.rank * node.size + node.rank, cross.size * node.size)
        return TwoHop(ranks, node, cross)

    def average(self):
        """prepare_sync()'s all-reduce: the first collectives of GIFT's reduction, and a work
        whose wait() drives the rest."""
        grads = internals.pseudo_gradients(self.fragment)
        works = internals.pending_works(self.fragment)
        device = next(iter(grads.values())).device
        errored, error = self.manager.errored(), None   # torchft skips collectives after one
        # the replica group's communicator for this sync: none issued after one fails
        node = None if self.node is None else StopAtFirstError(self.node)
        try:
            # errored or not, so that the group's ranks reach failed_locals together
            self.manager.wait_quorum()
            if not errored:
                pg = internals.process_group(self.manager)
                cross = StopAtFirstError(
                    ProcessGroupCommunicator(pg, internals.process_group_rank(pg)))
                fingerprints = self._fingerprints(cross, device)
                participating = self.manager.is_participating()
                if not participating:
                    for g in grads.values():
                        g.zero_()
                topology = self._topology(cross, node)
                self.described = topology.describe()
                sync = self.state.prepare(grads, topology, cross,
                                          self.manager.num_participants(),
                                          step=self.manager.current_step(),
                                          use_residuals=participating)
        except Exception as raised:
            error = raised
        if node is not None:
            # two hops: the group agrees before any of its ranks starts, or a rank that cannot
            # start would leave the others waiting in the group's collectives
            try:
                failed = failed_locals(node, errored or error is not None, device)
            except Exception as raised:
                error, failed = error or raised, []
            if error is None and failed and not errored:
                error = RuntimeError(f"GIFT: the sync across replicas could not start on local "
                                     f"rank(s) {failed} of this replica group")
        if errored or error is not None:
            if not errored:     # torchft's rule: report, zero, go on
                self._fail(error, grads)
            works.append(_Done())
            return
        self._check_agreement(fingerprints)     # a misconfiguration raises on every replica
        works.append(_GiftWork(self, sync.start(), grads))

    def _fingerprints(self, cross, device):
        """Every replica's fingerprint of its options and pseudo-gradients' sizes (one small
        allgather a sync): replicas that differ would exchange bytes that do not line up, and
        hang or mix them."""
        mine = torch.tensor(self.fingerprint, dtype=torch.int64, device=device)
        return cross.allgather_async(mine, "gift.diloco.agree").wait().view(cross.size, -1)

    def _check_agreement(self, fingerprints):
        differ = (fingerprints != fingerprints[0]).any(0).tolist()
        names = [k for k, bad in zip((*SHARED_OPTIONS, "the ranks a replica group reduces over",
                                      "the parameters' names and sizes"), differ) if bad]
        if names:
            verb = "differs" if len(names) == 1 else "differ"
            raise ValueError(f"GiftDiLoCo: fragment {self.index}: {', '.join(names)} {verb} "
                             f"across replicas; pass the same on every replica")

    def _fail(self, error, grads):
        logger.exception("GIFT: fragment %d's all-reduce failed; the outer step is discarded",
                         self.index)
        self.manager.report_error(error)
        for g in grads.values():
            g.zero_()

    def finish(self, sync, grads):
        try:
            bad = sync.finish()
        except Exception as error:
            self._fail(error, grads)
            return
        self.bytes_sent, self.cross_bytes = sync.bytes_sent, sync.cross_bytes
        if bad:
            message = (f"GIFT: the averaged pseudo-gradient of fragment {self.index} is not "
                       f"finite in {', '.join(bad[:3])}" + (" ..." if len(bad) > 3 else ""))
            if self.config.nonfinite == "raise":
                raise FloatingPointError(message)
            self._fail(FloatingPointError(message + "; the outer step is discarded"), grads)

    def settle(self, committed):
        """After should_commit(): keep the residuals the sync wrote, or undo them."""
        if committed:
            self.state.commit()
        else:
            self.state.rollback()


class _GiftWork:
    """What perform_sync() waits for: the rest of GIFT's reduction."""

    def __init__(self, owner, sync, grads):
        self.owner, self.sync, self.grads = owner, sync, grads
        self.done = False

    def wait(self, timeout=None):
        if not self.done:
            self.done = True
            self.owner.finish(self.sync, self.grads)
        return True


class _Done:
    def wait(self, timeout=None):
        return True


__all__ = ["GiftDiLoCo"]
