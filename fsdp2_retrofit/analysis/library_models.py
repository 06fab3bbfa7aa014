"""Models built by libraries: Hugging Face transformers, torchvision, timm.

The rewriter never imports these libraries. Where a model's repeated blocks live is
read from the name of the call that builds it and its literal arguments, against a
small table of layouts:

- transformers: `AutoModelForCausalLM.from_config(LlamaConfig(...))`,
  `LlamaForCausalLM.from_pretrained(...)`: the architecture is known from the class
  or the config class; its layers sit at a known path (`model.layers`, `transformer.h`,
  ...). A checkpoint named by a string (`from_pretrained("org/name")`) or a config
  read from one decides the class at run time: the generated code shards the
  modules whose class the model lists in `_no_split_modules` (the layers transformers
  itself never splits across devices).
- torchvision: `resnet50(...)`, `vit_b_16(...)`, `get_model("resnet50")`.
- timm: `create_model("vit_base_patch16_224")` with a literal name.

Unknown torchvision/timm names leave only the root sharded (reported).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver

Path_ = Tuple[str, ...]

# Hugging Face families, by the prefix of their class names ("Llama" of LlamaForCausalLM,
# LlamaConfig, LlamaModel): (base_model_prefix: the attribute of a head model (…ForCausalLM)
# that holds the base model, the path of the layers inside the base model, the layer class)
HF_LAYOUTS = {
    "Llama": ("model", ("layers",), "LlamaDecoderLayer"),
    "Mistral": ("model", ("layers",), "MistralDecoderLayer"),
    "Mixtral": ("model", ("layers",), "MixtralDecoderLayer"),
    "Qwen2": ("model", ("layers",), "Qwen2DecoderLayer"),
    "Qwen3": ("model", ("layers",), "Qwen3DecoderLayer"),
    "Gemma": ("model", ("layers",), "GemmaDecoderLayer"),
    "Gemma2": ("model", ("layers",), "Gemma2DecoderLayer"),
    "Phi": ("model", ("layers",), "PhiDecoderLayer"),
    "Phi3": ("model", ("layers",), "Phi3DecoderLayer"),
    "GPT2": ("transformer", ("h",), "GPT2Block"),
    "GPTJ": ("transformer", ("h",), "GPTJBlock"),
    "Falcon": ("transformer", ("h",), "FalconDecoderLayer"),
    "Bloom": ("transformer", ("h",), "BloomBlock"),
    "GPTNeoX": ("gpt_neox", ("layers",), "GPTNeoXLayer"),
    "OPT": ("model", ("decoder", "layers"), "OPTDecoderLayer"),
    "Bert": ("bert", ("encoder", "layer"), "BertLayer"),
    "Roberta": ("roberta", ("encoder", "layer"), "RobertaLayer"),
}
_PLACED = (
    "the model is placed by transformers/accelerate ({arg}): its parameters are spread over devices or "
    "quantized, with hooks moving them; fully_shard needs one ordinary module on the mesh device",
)
# keyword arguments of from_pretrained that leave nothing fully_shard can take over
HF_REFUSED_ARGUMENTS = {
    "device_map": ("FSR614", "`device_map=` places the model over devices with accelerate hooks",
                   _PLACED[0].format(arg="device_map"),
                   "drop device_map: the rewrite places each shard on its rank's device"),
    "load_in_8bit": ("FSR614", "`load_in_8bit=` quantizes the model with bitsandbytes",
                     "int8 weights are not trainable parameters FSDP2 can shard and reduce",
                     "train in bf16 (--mixed-precision bf16), or keep the script single-GPU"),
    "load_in_4bit": ("FSR614", "`load_in_4bit=` quantizes the model with bitsandbytes",
                     "4-bit weights are packed buffers FSDP2 cannot shard like parameters (QLoRA with FSDP "
                     "needs bnb_4bit_quant_storage and a library's own wrapping)",
                     "train in bf16 (--mixed-precision bf16), or keep the script single-GPU"),
    "quantization_config": ("FSR614", "`quantization_config=` quantizes the model",
                            "quantized weights are not trainable parameters FSDP2 can shard and reduce",
                            "train in bf16 (--mixed-precision bf16), or keep the script single-GPU"),
}
PEFT_WRAPPERS = "peft."
_NOT_MODELS = ("Tokenizer", "TokenizerFast", "Config", "Processor", "FeatureExtractor", "ImageProcessor")

_RESNET_LAYERS = tuple(("layer%d" % i,) for i in range(1, 5))
# torchvision builder functions (regex on the name) -> (container paths, block class, has BatchNorm)
TORCHVISION_LAYOUTS = (
    (r"resnet(18|34)", _RESNET_LAYERS, "BasicBlock", True),
    (r"resnet(50|101|152)|resnext\d+_\w+|wide_resnet\d+_\d+", _RESNET_LAYERS, "Bottleneck", True),
    (r"vit_[bhl]_\d+", (("encoder", "layers"),), "EncoderBlock", False),
)
# timm model names (regex on the name before its ".pretrained_tag") -> the same
TIMM_LAYOUTS = (
    (r"(vit|deit|deit3|beit|eva)_\w*", (("blocks",),), "Block", False),
    (r"convnext\w*", (("stages",),), "ConvNeXtStage", False),
    (r"resnet(18|34)d?", _RESNET_LAYERS, "BasicBlock", True),
    (r"(resnet|resnext|wide_resnet)\w*", _RESNET_LAYERS, "Bottleneck", True),
)
TIMM_BUILDERS = {"timm.create_model", "timm.models.create_model", "timm.models._factory.create_model"}


@dataclass(frozen=True)
class LibraryModel:
    """How a library model is sharded."""

    library: str  # "transformers", "torchvision", "timm"
    builder: str  # the qualified name of the call that builds it
    architecture: Optional[str]  # "Llama", "resnet50", "vit_base_patch16_224"; None: decided at run time
    containers: Tuple[Tuple[Path_, str], ...]  # (path from the model, block class), in forward order
    no_split_modules: bool  # shard the classes of `model._no_split_modules` at run time
    why: str  # how the blocks were found, for the report
    # has BatchNorm layers (what --mixed-precision must know); None: not known (an architecture
    # chosen at run time, or one the table lacks): SyncBatchNorm is made anyway, a no-op without any
    batchnorm: Optional[bool] = False
    # (refusal code, what, why, hint) when nothing safe can be done
    refusal: Optional[Tuple[str, str, str, str]] = None
    refusal_at: Optional[cst.CSTNode] = None  # the node the refusal points at (default: the build)


def namespace_base(resolver: Resolver, call: cst.Call) -> Optional[cst.BaseExpression]:
    """`models` of `models.__dict__[name](...)` or `getattr(models, name)(...)`: a callable
    picked by name from a module's namespace at run time; None for any other call."""
    func = call.func
    if type(func) is cst.Subscript and type(func.value) is cst.Attribute and func.value.attr.value == "__dict__":
        return func.value.value
    if type(func) is cst.Call and resolver.is_call_to(func, {"builtins.getattr"}) and len(func.args) == 2:
        return func.args[0].value
    return None


def namespace_builder(resolver: Resolver, call: cst.Call) -> Optional[str]:
    """`torchvision.models.get_model` for a model picked by name from a library's namespace
    at run time, `models.__dict__[args.arch](...)` or `getattr(models, args.arch)(...)` with
    `models` torchvision's: the same run-time choice as `get_model(args.arch)`; None otherwise."""
    base = namespace_base(resolver, call)
    for qname in resolver.qnames(base) if base is not None else ():
        if qname == "torchvision.models":
            return "torchvision.models.get_model"
    return None


def is_library_builder(qname: str) -> bool:
    """A call that builds a model of a library in the table."""
    return _hf_class(qname) is not None or _torchvision_name(qname) is not None or qname in TIMM_BUILDERS


def library_model(qname: str, call: Optional[cst.Call], resolver: Optional[Resolver]) -> Optional[LibraryModel]:
    """The layout of the model built by `call` (whose qualified name is `qname`); `call`
    None when the model comes out of a factory function (only the name is known)."""
    hf = _hf_class(qname)
    if hf is not None:
        found = _transformers(qname, hf, call, resolver)
        for keyword, refusal in HF_REFUSED_ARGUMENTS.items():
            if _argument(call, None, keyword) is not None:
                return replace(found, refusal=refusal)
        return found
    tv = _torchvision_name(qname)
    if tv is not None:
        if tv == "get_model":
            tv = _literal(_argument(call, 0, "name"))
        return _table("torchvision", qname, tv, TORCHVISION_LAYOUTS)
    if qname in TIMM_BUILDERS:
        return _table("timm", qname, _literal(_argument(call, 0, "model_name")), TIMM_LAYOUTS)
    return None


# -- transformers --------------------------------------------------------------


def _hf_class(qname: str) -> Optional[str]:
    """"AutoModelForCausalLM" for `transformers.AutoModelForCausalLM.from_config`,
    "LlamaForCausalLM" for `transformers.LlamaForCausalLM` (its constructor)."""
    if not qname.startswith("transformers."):
        return None
    parts = qname.split(".")
    if parts[-1] in ("from_pretrained", "from_config", "_from_config"):
        parts = parts[:-1]
    cls = parts[-1]
    if len(parts) < 2 or not cls[:1].isupper() or cls.endswith(_NOT_MODELS):
        return None
    if not (cls.startswith("AutoModel") or "For" in cls or cls.endswith(("Model", "LMHeadModel"))):
        return None
    return cls


def _family(cls: str) -> Optional[Tuple[str, str]]:
    """("Llama", "ForCausalLM") for LlamaForCausalLM: the longest known family prefix."""
    for family in sorted(HF_LAYOUTS, key=len, reverse=True):
        rest = cls[len(family):]
        if cls.startswith(family) and (rest.startswith(("For", "LMHead")) or rest in ("Model", "Config")):
            return family, rest
    return None


def _transformers(qname: str, cls: str, call, resolver) -> LibraryModel:
    head = not (cls in ("AutoModel",) or cls.endswith("Model") and not cls.endswith("LMHeadModel"))
    if cls.startswith("AutoModel"):
        config = _argument(call, 0, "config") if qname.endswith("from_config") else _argument(call, None, "config")
        config_cls = _config_class(config, call, resolver)
        found = _family(config_cls) if config_cls else None
        source = f"its config is a {config_cls}" if found else (
            "its class is known only at run time" if call is None
            else "the checkpoint's config decides the class at run time" if config is None
            else f"the class of its config `{_short(config)}` is not known before it runs"
        )
    else:
        found = _family(cls)
        source = f"the class is {cls}"
    if found is None:
        return LibraryModel(
            "transformers", qname, None, (), True,
            f"a transformers model ({source}): each module whose class the model lists in "
            "`_no_split_modules` (the layers transformers keeps whole) becomes a unit at run time",
        )
    family = found[0]
    prefix, path, block = HF_LAYOUTS[family]
    full = ((prefix,) if head else ()) + path
    return LibraryModel(
        "transformers", qname, family, ((full, block),), False,
        f"a transformers {family} model ({source}): its {block}s live in `.{'.'.join(full)}`; "
        "embeddings, final norm and head (tied or not) stay in the root unit",
    )


def _config_class(expr, call, resolver, depth: int = 3) -> Optional[str]:
    """"LlamaConfig" for `LlamaConfig(...)`, `LlamaConfig.from_pretrained(...)`, or a name
    bound to one earlier in the same function."""
    if expr is None or resolver is None or depth == 0:
        return None
    if isinstance(expr, cst.Name):
        bound = _last_binding(expr.value, call, resolver)
        return _config_class(bound, call, resolver, depth - 1) if bound is not None else None
    if isinstance(expr, cst.Call):
        for q in sorted(resolver.qnames(expr)):
            parts = q.split(".")
            if parts[-1] in ("from_pretrained", "from_dict"):
                parts = parts[:-1]
            if q.startswith("transformers.") and parts[-1].endswith("Config") and parts[-1] != "AutoConfig":
                return parts[-1]
    return None


def _last_binding(name: str, at: cst.CSTNode, resolver: Resolver):
    scope = resolver.enclosing_function(at)
    here = resolver.order(at)
    found = None
    for assign in resolver.nodes(cst.Assign):
        if resolver.enclosing_function(assign) is not scope or resolver.order(assign) > here:
            continue
        if len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name):
            if assign.targets[0].target.value == name:
                found = assign.value
    return found


# -- torchvision and timm --------------------------------------------------------


def _torchvision_name(qname: str) -> Optional[str]:
    if not qname.startswith("torchvision.models."):
        return None
    name = qname.rsplit(".", 1)[-1]
    return name if name[:1].islower() and not name.startswith("_") else None


def _table(library: str, qname: str, name: Optional[str], table) -> LibraryModel:
    if name is None:  # its BatchNorm layers are not known either: None, "may have"
        return LibraryModel(
            library, qname, None, (), False,
            f"a {library} model whose name is not a literal string: its blocks are not known before it runs; "
            "only the root is sharded (pass --shard CLASS to make each block of that class a unit)",
            None,
        )
    base = name.split(".")[0] if library == "timm" else name  # timm: "vit_base_patch16_224.augreg_in1k"
    for pattern, paths, block, batchnorm in table:
        if re.fullmatch(pattern, base):
            where = ", ".join("`." + ".".join(p) + "`" for p in paths)
            return LibraryModel(
                library, qname, name, tuple((p, block) for p in paths), False,
                f"{library} `{name}`: its {block}s live in {where}; stem and head stay in the root unit",
                batchnorm,
            )
    return LibraryModel(
        library, qname, name, (), False,
        f"{library} `{name}` is not in the table of known layouts: only the root is sharded "
        "(pass --shard CLASS to make each block of that class a unit)",
        None,
    )


# -- small helpers ---------------------------------------------------------------


def _argument(call: Optional[cst.Call], position: Optional[int], keyword: str):
    if call is None:
        return None
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a.value
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    if position is not None and len(positional) > position:
        return positional[position]
    return None


def _literal(expr) -> Optional[str]:
    return expr.evaluated_value if isinstance(expr, cst.SimpleString) else None


def _short(expr) -> str:
    from fsdp2_retrofit.syntax.names import code

    text = code(expr)
    return text if len(text) <= 40 else text[:37] + "..."
