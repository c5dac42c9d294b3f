"""An unknown name gets the registered one it most likely meant, whatever a paper calls it."""

import pytest
from conftest import invoke

from posbench.errors import did_you_mean
from posbench.schemes import SCHEMES


@pytest.mark.parametrize("alias", sorted(SCHEMES.aliases))
def test_every_alias_names_a_registered_scheme_and_is_not_one(alias):
    assert SCHEMES.aliases[alias] in SCHEMES and alias not in SCHEMES


def test_schemes_rotary_suggests_rope_as_the_readme_calls_it():
    """The README says "rotary", so `--schemes rotary` suggests rope."""
    res = invoke("extrapolate", "--schemes", "alibi,rotary")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "unknown scheme 'rotary' (did you mean 'rope'?)" in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("given", ["RoPE", "Rotary", "ALiBi", "Transformer-XL"])
def test_case_does_not_count_in_a_suggestion(given):
    want = SCHEMES.aliases.get(given.lower(), given.lower())
    assert did_you_mean(given, SCHEMES, SCHEMES.aliases) == f" (did you mean '{want}'?)"


def test_an_alias_is_suggested_never_taken():
    """A run's folder and records keep one name per scheme, so rotary is not a second name for rope."""
    from posbench.errors import PosbenchError

    with pytest.raises(PosbenchError, match="did you mean 'rope'"):
        SCHEMES.lookup("rotary")
    assert did_you_mean("zzz", SCHEMES, SCHEMES.aliases) == ""
