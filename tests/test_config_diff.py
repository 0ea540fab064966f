"""dept_mega/config_diff.py: where two JSON values differ, and the one ConfigError naming every
differing key with both values, its context and its advice."""
import pytest

from dept_mega.config import ConfigError
from dept_mega.config_diff import both, check_differing, differences
from dept_mega.parallel.agree import is_agreed


def _message(mine: dict, theirs: dict, advice: str = "every group job needs the same value", **kw) -> list[str]:
    rows = [(key + where, both(a, b, ("this job has", "the running groups have"))) for key in mine
            for where, a, b in differences(mine[key], theirs[key])]
    with pytest.raises(ConfigError) as exc:
        check_differing(rows, "from the running groups'", advice, **kw)
    return str(exc.value).split("\n")


@pytest.mark.parametrize("mine,theirs,want", [
    ({"train.seed": 7}, {"train.seed": 1},
     ["config key 'train.seed' differs from the running groups': this job has 7, the running groups have 1; "
      "every group job needs the same value"]),
    ({"train.seed": 7, "dept.local_steps": 3}, {"train.seed": 1, "dept.local_steps": 4},
     ["2 config keys differ from the running groups'; every group job needs the same value:",
      "  config key 'train.seed': this job has 7, the running groups have 1",
      "  config key 'dept.local_steps': this job has 3, the running groups have 4"]),
    # nested: each field that differs, dict keys sorted, list items by index; equal fields left out
    ({"optim": {"lr": 0.001, "min_lr": 0.0, "betas": [0.9, 0.95]}, "train.seed": 1},
     {"optim": {"lr": 0.003, "min_lr": 0.0, "betas": [0.9, 0.99]}, "train.seed": 1},
     ["2 config keys differ from the running groups'; every group job needs the same value:",
      "  config key 'optim.betas[1]': this job has 0.95, the running groups have 0.99",
      "  config key 'optim.lr': this job has 0.001, the running groups have 0.003"]),
])
def test_one_error_names_every_differing_key_with_both_values(mine, theirs, want):
    assert _message(mine, theirs) == want


def test_no_difference_no_error_hash_only_rows_and_agreed():
    check_differing([(key + w, "") for key in "ab" for w, _, _ in differences({"b": [1]}, {"b": [1]})], "anywhere")
    assert differences([1, 2], [1, 2, 3]) == [("", [1, 2], [1, 2, 3])]  # lists of other lengths: whole
    with pytest.raises(ConfigError, match="^config key 'optim' differs between the group jobs$") as exc:
        check_differing([("optim", "")], "between the group jobs")
    assert not is_agreed(exc.value)
    with pytest.raises(ConfigError) as exc:
        check_differing([("optim", ""), ("model", "")], "between the group jobs", "compare", agreed=True)
    assert is_agreed(exc.value) and str(exc.value).split("\n") == [
        "2 config keys differ between the group jobs; compare:", "  config key 'optim'", "  config key 'model'"]
