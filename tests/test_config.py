import re

import pytest

from dept_mega.config import ConfigError, load_config, save_config, validate


def _err(overrides, world=None, path=None):
    with pytest.raises(ConfigError) as exc:
        cfg = load_config(path, overrides)
        if world is not None:
            validate(cfg, world, check_files=False)
    return str(exc.value)


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4}\n"
                 "dept: {variant: glob, local_steps: 10}\ntrain: {steps: 20}\n")
    cfg = load_config(p, ["parallel.tensor=2", "dept.outer_optimizer.lr=0.7", "optim.lr=3e-4",
                          "data.sources=[{name: a, prefix: x}, {name: b, prefix: y, weight: 2}]",
                          "dept.sampling=proportional"])
    assert cfg.parallel.tensor == 2 and cfg.dept.outer_optimizer.lr == 0.7 and cfg.optim.lr == 3e-4
    assert [s.name for s in cfg.data.sources] == ["a", "b"] and cfg.data.sources[1].weight == 2.0
    assert cfg.model.query_groups == 4 and cfg.model.ffn_size == 256
    out = tmp_path / "resolved.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg


@pytest.mark.parametrize("overrides,needle", [
    (["foo=1"], "unknown config key 'foo'"),
    (["model.nope=1"], "unknown config key 'model.nope'"),
    (["model.num_layers=two"], "'model.num_layers'"),
    (["model.tie_embeddings=3"], "'model.tie_embeddings'"),
    (["dept.variant=bogus"], "'dept.variant'"),
    (["precision=fp64"], "'precision'"),
    (["model.num_attention_heads=5"], "num_attention_heads=5"),
    (["model.num_query_groups=5"], "'model.num_query_groups'"),
    (["parallel.tensor=5"], "'parallel.tensor'"),
    (["parallel.tensor"], "key.sub=value"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"], "'train.global_batch_size'"),
    (["dept.local_steps=3", "train.steps=10"], "'dept.local_steps'"),
    (["dept.variant=glob", "dept.embedding_rows=present", "dept.outer_fragments=2", "model.num_layers=2"],
     "'dept.embedding_rows': present needs dept.outer_overlap false and dept.outer_fragments 1 (a sync that lands "
     "inside a round is undone"),
    (["parallel.pipeline=3", "parallel.virtual_pipeline=2", "model.num_layers=6", "train.global_batch_size=8",
      "train.micro_batch_size=2"], "config key 'train.global_batch_size': parallel.virtual_pipeline > 1 needs the "
                                  "micro-batches per step (4 = global_batch_size / (micro_batch_size × data)) to be a "
                                  "multiple of parallel.pipeline=3"),
    (["fp8=e4m3", "precision=fp32"], "'fp8'"),
    (["data.sources=[{name: a, prefix: x}, {name: a, prefix: y}]"], "duplicate"),
    (["dept.body_optimizer_state=shared"], "config key 'dept.body_optimizer_state': 'shared' is not one of group"),
    (["dept.body_optimizer_state=source", "dept.variant=std"], "'dept.body_optimizer_state': source needs a DEPT"),
    (["dept.body_optimizer_state=source", "dept.reset_inner_optimizer=true", "dept.local_steps=1"],
     "'dept.body_optimizer_state': source keeps"),
])
def test_bad_values_name_the_key(overrides, needle):
    assert needle in _err(overrides)


@pytest.mark.parametrize("key", ["fp8_fused_casts", "optim.fused", "train.tensorboard"])
@pytest.mark.parametrize("value", ["auto", "1"])
def test_an_optional_bool_key_names_null_among_its_values(key, value):
    """A key whose null means 'chosen automatically' (the run log may print that choice as auto)
    says that null is its third value, not only true or false; a plain bool key does not."""
    msg = _err([f"{key}={value}"])
    assert f"config key '{key}': expected true, false or null (null: chosen automatically" in msg, msg
    assert load_config(None, [f"{key}=null"]) is not None
    assert "config key 'model.tie_embeddings': expected true or false, got 'auto'" in _err(["model.tie_embeddings=auto"])


def test_a_source_weight_that_uniform_sampling_would_ignore_is_refused():
    """A weight (Megatron's --data-path 0.3 A 0.7 B habit) does nothing under the default
    dept.sampling=uniform; it is refused with the sampling modes that use it, not ignored."""
    two = "data.sources=[{name: a, prefix: x, weight: 0.3}, {name: b, prefix: y}]"
    msg = _err([two])
    assert msg.startswith("config key 'data.sources[0].weight': 0.3 has no effect under dept.sampling=uniform"), msg
    assert "dept.sampling=weights (the weights alone are the shares" in msg and "proportional" in msg
    for sampling in ("proportional", "temperature", "weights"):
        assert load_config(None, [two, f"dept.sampling={sampling}"]).data.sources[0].weight == 0.3
    load_config(None, ["data.sources=[{name: a, prefix: x, weight: 1.0}]"])  # the default weight is fine


def test_unknown_key_suggests_the_closest(tmp_path):
    """A typo names the key it probably meant (in the file, in an override, in a list item);
    a key near nothing names only itself."""
    assert "'model.hiden_size'; did you mean 'model.hidden_size'?" in _err(["model.hiden_size=8"])
    assert "did you mean 'data.sources.0.tokenizer'?" in _err(["data.sources=[{name: a, prefix: x}]",
                                                                "data.sources.0.tokenzer=t"])
    p = tmp_path / "c.yaml"
    p.write_text("dept: {local_step: 10}\ndata: {sources: [{name: a, prefx: x}]}\n")
    assert "'dept.local_step'; did you mean 'dept.local_steps'?" in _err([], path=p)
    p.write_text("data: {sources: [{name: a, prefx: x}]}\n")
    assert "'data.sources[0].prefx'; did you mean 'data.sources[0].prefix'?" in _err([], path=p)
    assert "did you mean" not in _err(["model.colour=1"])
    # a key near nothing may be another trainer's name for a setting: the mapping is pointed at
    msg = _err(["optim.adam_beta1=0.9"])
    assert msg == ("unknown config key 'optim.adam_beta1' (every key: docs/config.md; Megatron-LM's and "
                   "torchtitan's settings and their keys here: docs/migrating.md)"), msg
    assert "migrating" not in _err(["model.hiden_size=8"])


def test_world_size_checks():
    base = ["dept.local_steps=10", "train.steps=20", "model.vocab_size=100"]
    assert "world size 6" in _err(base + ["parallel.tensor=4"], world=6)
    assert "std trains one group" in _err(base + ["dept.variant=std"], world=2)
    # the fix is named: the data-parallel size Megatron-LM would have inferred
    msg = _err(base + ["dept.variant=std", "parallel.tensor=2"], world=8)
    assert "tensor×pipeline×data=2×1×1=2 gives 4 groups: set parallel.data=4 " in msg, msg
    assert "or launch 2 process(es)" in msg
    # a world the layout does not divide (4-GPU nodes: 32 ranks for data 64) names it too
    msg = _err(base + ["dept.variant=std", "parallel.data=64"], world=32)
    assert msg.endswith("= 1×1×64 = 64; std trains one group: set parallel.data=32 (world size / (tensor × "
                        "pipeline); Megatron-LM infers the data-parallel size, dept_mega does not: the ranks left "
                        "over form DEPT source groups), or launch 64 process(es)"), msg
    assert "std trains one group" not in _err(base + ["dept.variant=glob", "parallel.data=64"], world=32)
    two = "data.sources=[{name: a, prefix: x, tokenizer: t}, {name: b, prefix: y, tokenizer: u}]"
    assert "at least one source per group" in _err(base + ["dept.variant=spec", two], world=4)
    assert "needs a tokenizer" in _err(base + ["dept.variant=spec_opt",
                                               "data.sources=[{name: a, prefix: x}]"], world=1)


def test_missing_files_named(tmp_path):
    cfg = load_config(None, ["dept.variant=glob", "dept.local_steps=10", "train.steps=20",
                             f"data.tokenizer={tmp_path}/tok.model",
                             f"data.sources=[{{name: a, prefix: {tmp_path}/a}}]"])
    with pytest.raises(ConfigError, match="data.tokenizer"):
        validate(cfg, 1)
    (tmp_path / "tok.model").write_text("x")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].prefix"):
        validate(cfg, 1)


def test_missing_data_file_hints_the_prefix(tmp_path):
    """A prefix given as tools/preprocess_data.py's --output-prefix, or with the file's extension
    written out, names the prefix that exists; a prefix near nothing says only what is missing."""
    for ext in (".bin", ".idx"):
        (tmp_path / f"en_text_document{ext}").write_bytes(b"")

    def err(prefix):
        cfg = load_config(None, ["dept.variant=glob", "dept.local_steps=10", "train.steps=20",
                                 "model.vocab_size=100", f"data.sources=[{{name: en, prefix: {prefix}}}]"])
        with pytest.raises(ConfigError) as exc:
            validate(cfg, 1)
        return str(exc.value)

    want = repr(str(tmp_path / "en_text_document"))
    assert err(tmp_path / "en").endswith(f"appends _<json key>_document to its --output-prefix: did you mean {want}?")
    assert err(tmp_path / "en_text_document.bin").endswith(f"the prefix is the path without '.bin' / '.idx': {want}")
    assert err(tmp_path / "en_text_document.idx").endswith(f"the prefix is the path without '.bin' / '.idx': {want}")
    assert err(tmp_path / "fr").endswith("does not exist (source 'en')")


def test_missing_config_file():
    assert "does not exist" in _err([], path="/nonexistent/cfg.yaml")


def test_source_groups():
    """data.sources[i].group: which group owns (trains) a source; checked against the number of
    groups (the world's, or federation.groups), every group owning at least one source."""
    from dept_mega.config import source_groups
    base = ["dept.local_steps=10", "train.steps=20", "model.vocab_size=100", "dept.variant=spec"]
    four = "data.sources=[{name: a, prefix: x}, {name: b, prefix: y}, {name: c, prefix: z, group: %s}, " \
           "{name: d, prefix: w}]"
    assert "'data.sources[2].group': 2 is not a group index in [0, 2)" in _err(base + [four % 2], world=2)
    assert "'data.sources[2].group': -1 is not" in _err(base + [four % -1], world=2)
    # every source in group 0: group 1 owns none
    none = ("data.sources=[{name: a, prefix: x}, {name: b, prefix: y, group: 0}, {name: c, prefix: z, group: 0}, "
            "{name: d, prefix: w, group: 0}]")
    assert "'data.sources[].group': group 1 of 2 owns no source" in _err(base + [none], world=2)
    cfg = load_config(None, base + [four % 1])
    validate(cfg, 2, check_files=False)
    assert source_groups(cfg, 2) == [0, 1, 1, 1]
    plain = load_config(None, base + ["data.sources=[{name: a, prefix: x}, {name: b, prefix: y}, "
                                      "{name: c, prefix: z}]"])
    assert source_groups(plain, 2) is None  # no key, one job: any group trains any source
    fed = ["federation.lighthouse=h:1", "federation.groups=2"]
    plain = load_config(None, base + fed + ["data.sources=[{name: a, prefix: x}, {name: b, prefix: y}, "
                                            "{name: c, prefix: z}]"])
    assert source_groups(plain, 2) == [0, 1, 0]  # federation, K > G: i mod G
    assert "'data.sources[2].group': 3 is not a group index in [0, 2)" in _err(base + fed + [four % 3], world=1)


@pytest.mark.parametrize("key", sorted(__import__("dept_mega.config_schema", fromlist=["CHOICES"]).CHOICES))
def test_every_key_with_choices_refuses_another_value_naming_them(key):
    """CHOICES is the one place a key's allowed values are checked: any other value is refused
    with the key and the values it takes."""
    from dept_mega.config_schema import CHOICES
    shown = " | ".join("null" if a is None else str(a) for a in CHOICES[key])
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}': 'not_a_choice' is not one of {shown}")):
        load_config("examples/tiny/std.yaml", [f"{key}=not_a_choice"])


def test_errors_say_when_a_key_is_its_default(tmp_path):
    """A minimal config leaves dept.variant (spec_opt) and dept.local_steps (500) at their
    defaults: the errors those defaults cause say so; a key the file or an override set is
    named without the note (docs/config.md holds the defaults)."""
    p = tmp_path / "min.yaml"
    p.write_text("data:\n  sources:\n    - {name: en, prefix: x}\ntrain: {steps: 10}\n")
    msg = _err([], path=p)
    assert msg == ("config key 'dept.local_steps': train.steps=10 is not a multiple of 500 (the default; a round is "
                   "dept.local_steps inner steps: set it to a divisor of train.steps) under dept.variant spec_opt (the "
                   "default; dept.variant: std trains without rounds)"), msg
    msg = _err(["dept.local_steps=5"], world=1, path=p)
    assert msg == ("config key 'data.sources[0].tokenizer': spec_opt needs a tokenizer for source 'en' under "
                   "dept.variant spec_opt (the default; spec_opt gives each source its own data.sources[].tokenizer; "
                   "glob, trim and spec use one global data.tokenizer)"), msg
    # set by the user, in the file or by an override: no note
    assert _err(["dept.local_steps=500"], path=p) == ("config key 'dept.local_steps': train.steps=10 is not a multiple "
                                                      "of 500 under dept.variant spec_opt (the default; dept.variant: "
                                                      "std trains without rounds) (dept.local_steps set by the override "
                                                      "dept.local_steps=500)")
    p2 = tmp_path / "set.yaml"
    p2.write_text("dept: {variant: spec_opt, local_steps: 500}\ndata:\n  sources:\n    - {name: en, prefix: x}\n"
                  "train: {steps: 10}\n")
    assert _err([], path=p2) == (f"config key 'dept.local_steps': train.steps=10 is not a multiple of 500 "
                                 f"(dept.local_steps set in {p2}, line 1)")
    assert _err(["dept.local_steps=5"], world=1, path=p2) == ("config key 'data.sources[0].tokenizer': spec_opt needs "
                                                              "a tokenizer for source 'en'")
    # a section set as a whole counts as its keys set
    assert "(the default" not in _err(["dept={variant: spec_opt, local_steps: 500}"], path=p)


def test_a_bad_value_names_the_override_or_the_file_line_that_set_it(tmp_path):
    """A value error says where the value came from: the override that set the key (or the
    section holding it), else the config file's line; a key neither set says nothing more."""
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  hidden_size: 64\ntrain:\n  steps: ten\ndata:\n  sources:\n    - name: en\n"
                 "      prefix: x\n    - name: fr\n      prefix: y\n      weight: heavy\n")
    assert _err([], path=p).endswith(f"got 'ten' (train.steps set in {p}, line 4)")
    assert _err(["train.steps=eleven"], path=p).endswith("got 'eleven' (train.steps set by the override "
                                                         "train.steps=eleven)")
    assert _err(["train={steps: twelve}"], path=p).endswith("(train.steps set by the override train={steps: twelve})")
    assert _err(["train.steps=3"], path=p).endswith(f"(data.sources[1].weight set in {p}, line 11)")
    r = tmp_path / "r.yaml"
    r.write_text("train:\n  steps: 3\n  stepz: 4\n")  # a misspelt key: its line (one typed on the command line: itself)
    assert _err([], path=r).endswith(f"did you mean 'train.steps'? (every key: docs/config.md) (train.stepz set in {r}, "
                                     f"line 3)")
    assert _err(["train.steps=3", "data.sources.1.weight=much"], path=p).endswith(
        "(data.sources[1].weight set by the override data.sources.1.weight=much)")
    # a section the file sets whose key it leaves out, an override of another key: nothing added
    q = tmp_path / "d.yaml"
    q.write_text("train:\n  save_interval: 1\n")
    msg = _err(["model.num_attention_heads=7"], path=q)
    assert msg.startswith("config key 'model.hidden_size'") and " set " not in msg, msg
