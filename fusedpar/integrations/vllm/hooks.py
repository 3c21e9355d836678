"""The hooks fusedpar puts on the model vLLM builds, and the pieces they switch per step.

`ModelHooks` records the linear layers fusedpar takes over (`adopt`, from layers.py), watches for
the model that holds the first of them (`watch_for_root`) and, once it is assembled, installs:
  - a forward pre-hook on the root (the causal LM, outside vLLM's compiled region) that reads the
    step's token count and calls the worker's begin_step (state.py);
  - a forward hook on the root that calls the worker's end_step;
  - a wrapper of the root's compute_logits that counts the steps vLLM replays as full CUDA graphs
    (counters.StepCounter).
For a base step (`enter`) the decoder model's forward is the base runner's (base_runner.py) and
vLLM's custom ops dispatch to their eager kernels (base_step.BaseKernels); `leave` restores both.
"""

from __future__ import annotations

import inspect
import logging

from fusedpar.layouts import StepMode

from .config import SUPPORTED_ARCHITECTURES, FusedparConfigError

logger = logging.getLogger("vllm.fusedpar")


class ModelHooks:
    """The model of one worker as fusedpar sees it (see the module docstring).

    worker: the state.WorkerState whose begin_step / end_step the root's hooks call, whose step
    counter counts the logits calls, and on whose current step the base runner runs.
    """

    def __init__(self, worker):
        self.worker = worker
        self.layer_prefix: str | None = None  # "model.layers.0" of the first layer taken over
        self.layers_taken: dict[str, int] = {}
        self.modules: list = []  # the linear layers taken over (their weights are the base shards)
        self._taken: set[int] = set()  # their ids
        self.root = self.decoder_model = None
        self.base_kernels = None  # base_step.BaseKernels, once the model is built
        self.runner = None  # base_runner.BaseRunner, once the model is built
        self.dp_runner = None  # dp_runner.DPRunner, once the model is built, in an engine with a DP layout
        self._watchers: list = []

    # ---- the layers taken over ----------------------------------------------------------------
    def adopt(self, layer, kind: str, layer_prefix: str) -> None:
        """Record `layer` (a fusedpar linear layer of `kind` in the decoder layer `layer_prefix`)."""
        if kind == "qkv":
            self.watch_for_root(layer_prefix)
        self.layers_taken[kind] = self.layers_taken.get(kind, 0) + 1
        self.modules.append(layer)
        self._taken.add(id(layer))

    def holds(self, module) -> bool:
        """Whether `module` is one of the linear layers taken over."""
        return id(module) in self._taken

    def first_layer(self) -> dict:
        """The first decoder layer's linear layers taken over, by kind."""
        first = {}
        for mod in self.modules:
            first.setdefault(mod._fp_kind, mod)
        return first

    # ---- watching for the root ----------------------------------------------------------------
    def watch_for_root(self, layer_prefix: str) -> None:
        """Remember the first decoder layer and install the per-model hooks as soon as the model that
        holds it is assembled (before any forward: the first step already honours the threshold).

        Layers cannot see their parents while the model is being built. A module-registration hook
        sees the root assign its decoder model (`self.model = LlamaModel(...)`), whose layers are
        complete by then; `layer_prefix` ("model.layers.0") names that assignment. A forward pre-hook
        guards the other way round: a model that runs before its hooks were installed (vLLM built it
        some other way, e.g. its Transformers backend) is an error, not a silent shift-only engine.
        """
        if self.layer_prefix is not None:
            return
        self.layer_prefix = layer_prefix
        from torch.nn.modules.module import register_module_forward_pre_hook, register_module_module_registration_hook

        self._watchers = [register_module_module_registration_hook(self._on_register),
                          register_module_forward_pre_hook(self._unhooked_call)]

    def _holds_first_layer(self, module, path: str) -> bool:
        try:
            target = module.get_submodule(f"{path}.self_attn.qkv_proj" if path else "self_attn.qkv_proj")
        except AttributeError:
            return False
        return self.holds(target)

    def _on_register(self, parent, name, child):
        first, _, rest = self.layer_prefix.partition(".")
        if self.root is None and name == first and rest and self._holds_first_layer(child, rest):
            self._stop_watching()
            self.install(parent, child)
        return None

    def _unhooked_call(self, module, args):
        if self.root is None and self._holds_first_layer(module, self.layer_prefix):
            self._stop_watching()
            raise FusedparConfigError(
                f"fusedpar: vLLM runs this model as {type(module).__name__}, which fusedpar did not see being "
                f"assembled; fusedpar hooks into vLLM's own {', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' "
                "or 'vllm')")
        return None

    def _stop_watching(self) -> None:
        for handle in self._watchers:
            handle.remove()
        self._watchers = []

    # ---- the hooks ----------------------------------------------------------------------------
    def install(self, root, inner) -> None:
        """Hooks on `root` (the causal LM) and its decoder model `inner` (root.<first part of layer_prefix>)."""
        if type(root).__name__ not in SUPPORTED_ARCHITECTURES:  # e.g. vLLM's Transformers backend
            raise FusedparConfigError(
                f"fusedpar: vLLM runs this model as {type(root).__name__}; fusedpar hooks into vLLM's own "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' or 'vllm')")
        model_path, _, rest = self.layer_prefix.partition(".")
        layers_path, _, idx = rest.rpartition(".")
        layers = inner.get_submodule(layers_path)
        if int(idx) != 0 or len(layers) == 0:
            raise RuntimeError(f"fusedpar: expected {self.layer_prefix} to be the first decoder layer")
        norm = getattr(inner, "norm", None)
        if norm is None:
            raise RuntimeError(f"fusedpar: {type(inner).__name__} has no final norm to gather the sequence at")
        n_taken = dict(self.layers_taken)
        expected = len(layers)
        if any(v != expected for v in n_taken.values()) or len(n_taken) != 4:
            raise RuntimeError(f"fusedpar: took over {n_taken} linear layers; expected 4 kinds x {expected} layers")
        acts, attns = [], []
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            act = getattr(mlp, "act_fn", None)
            if act is None or not self.holds(getattr(mlp, "gate_up_proj", None)):
                raise RuntimeError(f"fusedpar: {type(layer).__name__} has no mlp.act_fn after fusedpar's gate_up_proj")
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attn is None:
                raise RuntimeError(f"fusedpar: {type(layer).__name__} has no self_attn.attn (vLLM's Attention)")
            acts.append(act)
            attns.append(attn)
        from .base_runner import BaseRunner
        from .base_step import BaseKernels

        dep = self.worker.deployment
        self.base_kernels = BaseKernels(inner, acts, dep.layout.sp, cuda=dep.is_cuda)
        self.runner = BaseRunner(self.worker, inner, layers, norm, attns, self.base_kernels)
        if dep.cfg.dp_size:
            from .dp_runner import DPRunner

            self.dp_runner = DPRunner(self.worker, inner, layers, norm, attns, dep.layout.replica_size)
        self.root, self.decoder_model = root, inner
        root.register_forward_pre_hook(self._root_pre, with_kwargs=True)
        root.register_forward_hook(self._root_post)
        logits = root.compute_logits
        counter, worker, dp_runner = self.worker.counter, self.worker, self.dp_runner

        def compute_logits(hidden_states, *args, **kwargs):  # every step's logits, replayed steps' too
            # the sampler passes hidden_states[logits_indices], a tensor of its own; prompt logprobs pass
            # slices (views) of a step's hidden states, several per step: not steps
            if hidden_states._base is None:
                counter.logits(int(hidden_states.shape[0]))
            if worker.dp_logits:  # after a DP step: this rank's rows, with every rank's (dp_runner.DPVocab)
                return dp_runner.vocab.logits(hidden_states)
            return logits(hidden_states, *args, **kwargs)

        root.compute_logits = compute_logits
        logger.info("fusedpar: hooks on %s (mode per step); base steps run %s.forward as fusedpar's base runner "
                    "over %s.%s and switch %s", type(root).__name__, model_path, model_path, layers_path,
                    self.base_kernels.describe())

    def _root_pre(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        if x is None:
            x = kwargs.get("positions")

        def compile_shift():  # the root's own call of its decoder model (vLLM's llama.py / qwen2.py / qwen3.py)
            inputs = inspect.signature(module.forward).bind(*args, **kwargs).arguments  # once: not per step
            self.decoder_model(inputs.get("input_ids"), inputs.get("positions"), inputs.get("intermediate_tensors"),
                               inputs.get("inputs_embeds"))

        self.worker.begin_step(int(x.shape[0]) if x is not None else 0, compile_shift)
        return None

    def _root_post(self, module, args, output):
        self.worker.end_step()
        return None

    # ---- per step -----------------------------------------------------------------------------
    def enter(self, mode: StepMode) -> None:
        """Set the model up for a step in `mode`: in base mode vLLM's eager kernels and, as the decoder
        model's forward (vLLM calls it when the step skips the compiled graph), the base runner's."""
        if self.runner is None:
            return
        self.base_kernels.end()
        self.runner.ran = False
        if mode is StepMode.BASE:
            self.base_kernels.begin()
            self.decoder_model.forward = self.runner.forward

    def enter_dp(self) -> None:
        """Set the model up for a DP step: the decoder model's forward is the DP runner's."""
        if self.dp_runner is None:
            raise RuntimeError("fusedpar DP: a DP step before the model's hooks were installed")
        self.base_kernels.end()
        self.runner.ran = self.dp_runner.ran = False
        self.decoder_model.forward = self.dp_runner.forward

    def leave(self) -> bool:
        """Restore vLLM's model after a step; whether the step ran the base runner (or, in a DP step, the
        DP runner)."""
        if self.runner is None:
            return False
        self.base_kernels.end()
        self.decoder_model.__dict__.pop("forward", None)  # the class's forward again
        ran, self.runner.ran = self.runner.ran, False
        if self.dp_runner is not None:
            ran, self.dp_runner.ran = ran or self.dp_runner.ran, False
        return ran
