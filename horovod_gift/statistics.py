"""Whitening statistics: E[x x^T] of every nn.Linear's input, averaged over ranks, and factors that
are bit-identical on every rank (each layer's factors are computed by one rank and broadcast)."""
import torch
import horovod.torch as hvd

from .geometry import InputWhitening


class WhiteningStatistics:
    """Forward pre-hooks on the nn.Linear layers whose weights are trained; every `stat_every` steps
    the hooks sum x x^T over that step's forward passes and refresh() turns the sums into factors."""

    def __init__(self, model, params, rank, damping, stat_every, process_set):
        self.stat_every, self.rank, self.process_set = stat_every, rank, process_set
        self.whitening, self._sums, self._tokens = {}, {}, {}
        self.current_step = 0
        self._handles = []
        for module_name, module in model.named_modules():
            weight = f"{module_name}.weight" if module_name else "weight"
            if isinstance(module, torch.nn.Linear) and weight in params:
                self.whitening[weight] = InputWhitening(module.in_features, rank=rank, damping=damping)
                self._handles.append(module.register_forward_pre_hook(self._hook(weight)))

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()

    def _hook(self, name):
        def collect(module, inputs):
            if self.due(self.current_step) and module.training and torch.is_grad_enabled():
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float32)
                xtx = (x.t() @ x).to(torch.float64)
                self._sums[name] = self._sums[name] + xtx if name in self._sums else xtx
                self._tokens[name] = self._tokens.get(name, 0) + x.shape[0]
        return collect

    def due(self, step):
        return bool(self.whitening) and step % self.stat_every == 0

    def refresh(self):
        """Average this step's sums over ranks, update every layer's EMA, compute its factors on rank
        (layer index mod ranks) and broadcast them. Returns {weight name: previous factors} of the
        layers whose factors changed."""
        names = sorted(self.whitening)
        handles = []
        for name in names:
            w = self.whitening[name]
            local = self._sums.get(name, torch.zeros(w.in_features, w.in_features, dtype=torch.float64))
            packed = torch.cat([local.reshape(-1), torch.tensor([float(self._tokens.get(name, 0))], dtype=torch.float64)])
            handles.append(hvd.allreduce_async(packed, op=hvd.Sum, name=f"gift.stats.{name}", process_set=self.process_set))
        self._sums, self._tokens = {}, {}
        n, me = self.process_set.size(), self.process_set.rank()
        updated = []
        for i, (name, handle) in enumerate(zip(names, handles)):
            packed = hvd.synchronize(handle)
            tokens, w = float(packed[-1]), self.whitening[name]
            if tokens == 0 or not torch.isfinite(packed).all():      # identical verdict on every rank
                continue
            owner = i % n
            w.set_covariance(w.blend(packed[:-1].view(w.in_features, w.in_features) / tokens), refresh=owner == me)
            flat = w.factors_to_tensor() if owner == me else torch.empty(w.factor_numel())
            root = self.process_set.ranks[owner] if self.process_set.ranks else owner   # Horovod wants a global rank
            updated.append((name, hvd.broadcast_async(flat, root_rank=root, name=f"gift.factors.{name}",
                                                      process_set=self.process_set)))
        changed = {}
        for name, handle in updated:
            w = self.whitening[name]
            changed[name] = w.factors
            w.factors = w.factors_from_tensor(hvd.synchronize(handle))
        return changed

    def state_dict(self):
        return {name: w.state_dict() for name, w in self.whitening.items()}

    def load_state_dict(self, state):
        for name, w in self.whitening.items():
            w.load_state_dict(state[name])
