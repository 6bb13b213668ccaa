from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.cel import (
    MAX_EXPRESSION_LENGTH,
    CelDevice,
    CelError,
    CelErrorKind,
    SelectorEvaluator,
    Semver,
    compile_selector,
    evaluate,
)

DRIVER = "mig.carve.dev"
GI = 2**30


def mig_device(
    profile: str = "3g.40gb",
    memory: int = 40 * GI,
    uuid: str = "GPU-1",
    driver_version: str = "550.54.15",
) -> CelDevice:
    return CelDevice.of(
        DRIVER,
        {
            "type": "mig",
            "profile": profile,
            "profileId": 9,
            "productName": "NVIDIA H100 80GB HBM3",
            "parentUUID": uuid,
            "driverVersion": Semver.parse(driver_version),
            "cudaComputeCapability": Semver.parse("9.0.0"),
            "resource.kubernetes.io/pciBusID": "0000:3b:00.0",
        },
        {"memory": Decimal(memory), "multiprocessors": Decimal(60)},
    )


def check(expression: str, device: CelDevice | None = None) -> bool | CelError:
    return SelectorEvaluator().matches(expression, device or mig_device())


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ('device.driver == "mig.carve.dev"', True),
        ('device.attributes["mig.carve.dev"].type == "mig"', True),
        ('device.attributes["mig.carve.dev"].profile == "1g.10gb"', False),
        ("device.attributes[device.driver].profileId == 9", True),
        ('device.attributes["resource.kubernetes.io"].pciBusID.startsWith("0000:3b")', True),
        ('device.capacity["mig.carve.dev"].memory.compareTo(quantity("40Gi")) == 0', True),
        ('device.capacity["mig.carve.dev"].memory.compareTo(quantity("41Gi")) < 0', True),
        ('device.capacity["mig.carve.dev"].memory.isGreaterThan(quantity("20Gi"))', True),
        ('device.capacity["mig.carve.dev"].memory.isLessThan(quantity("20Gi"))', False),
        ('device.capacity["mig.carve.dev"].memory == quantity("40960Mi")', True),
        ('quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")', True),
        ('quantity("1500m").isInteger()', False),
        ('quantity("2k").asInteger() == 2000', True),
        ('quantity("-1").sign() == -1', True),
        ('isQuantity("1Gi") && !isQuantity("one gig")', True),
        ('device.attributes["mig.carve.dev"].driverVersion.isGreaterThan(semver("550.0.0"))', True),
        ('device.attributes["mig.carve.dev"].driverVersion.isLessThan(semver("550.54.14"))', False),
        (
            'device.attributes["mig.carve.dev"].cudaComputeCapability.compareTo(semver("9.0.0"))'
            " == 0",
            True,
        ),
        ('semver("v9", true) == semver("9.0.0")', True),
        ('semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))', True),
        ('semver("2.3.4").minor() == 3', True),
        ('isSemver("1.2") == false && isSemver("1.2", true)', True),
        ('has(device.attributes["mig.carve.dev"].uuid)', False),
        ('"profile" in device.attributes["mig.carve.dev"]', True),
    ],
)
def test_kubernetes_environment(expression: str, expected: bool) -> None:
    assert check(expression) is expected


@pytest.mark.parametrize(
    ("expression", "kind", "fragment"),
    [
        ('device.attributes["mig.carve.dev"].nosuch == "x"', CelErrorKind.RUNTIME, "'nosuch'"),
        ('device.attributes["other.example.com"].type == "x"', CelErrorKind.RUNTIME, "other"),
        (
            'device.capacity["mig.carve.dev"].memory.compareTo(semver("1.0.0")) == 0',
            CelErrorKind.RUNTIME,
            "cannot compare quantity with semver",
        ),
        ('quantity("forty gigs") == quantity("1")', CelErrorKind.RUNTIME, "invalid quantity"),
        ('semver("1.2") == semver("1.2.0")', CelErrorKind.RUNTIME, "invalid semantic version"),
        ('device.attributes["mig.carve.dev"].profile ==', CelErrorKind.SYNTAX, "parse"),
        ('device.attributes["mig.carve.dev"].profileId', CelErrorKind.NOT_BOOLEAN, "int"),
    ],
)
def test_errors_are_values_naming_expression_and_problem(
    expression: str, kind: CelErrorKind, fragment: str
) -> None:
    result = check(expression)
    assert isinstance(result, CelError)
    assert result.kind is kind
    assert fragment in result.message
    assert expression[:40] in result.message


@pytest.mark.parametrize(
    "expression",
    [
        # cel-go's strings extension (version 2, in Kubernetes' base environment since 1.29);
        # the cases are those of cel-go's ext/strings documentation
        "'TacoCat'.lowerAscii() == 'tacocat'",
        "'TacoCÆt Xii'.lowerAscii() == 'tacocÆt xii'",  # ASCII only
        "'TacoCÆt Xii'.upperAscii() == 'TACOCÆT XII'",
        "'hello'.charAt(4) == 'o' && 'hello'.charAt(5) == ''",
        "'hello mellow'.indexOf('') == 0 && 'hello mellow'.indexOf('ello') == 1",
        "'hello mellow'.indexOf('jello') == -1 && 'hello mellow'.indexOf('ello', 6) == 7",
        "'ta©o©ßT'.indexOf('©') == 2 && 'ta©o©ßT'.indexOf('©', 3) == 4",  # code points
        "'hello mellow'.lastIndexOf('') == 12 && 'hello mellow'.lastIndexOf('ello') == 7",
        "'hello mellow'.lastIndexOf('jello') == -1 && 'hello mellow'.lastIndexOf('ello', 6) == 1",
        "'ta©o©ßT'.lastIndexOf('©') == 4",
        "'hello hello'.replace('he', 'we') == 'wello wello'",
        "'hello hello'.replace('he', 'we', 1) == 'wello hello'",
        "'hello hello'.replace('he', 'we', 0) == 'hello hello'",
        "'hello world'.split(' ') == ['hello', 'world']",
        "'hello world events!'.split(' ', 2) == ['hello', 'world events!']",
        "'hello world events!'.split(' ', 0) == []",
        "'tacocat'.substring(4) == 'cat' && 'tacocat'.substring(0, 4) == 'taco'",
        "'  \\ttrim\\n    '.trim() == 'trim'",
        "['hello', 'mellow'].join() == 'hellomellow'",
        "['hello', 'mellow'].join(' ') == 'hello mellow'",
        # Kubernetes' lists library
        "[1, 2, 3, 2].indexOf(2) == 1 && [1, 2, 3, 2].lastIndexOf(2) == 3",
        "device.attributes['mig.carve.dev'].productName.lowerAscii().matches('^.*h100.*$')",
    ],
)
def test_kubernetes_string_extension(expression: str) -> None:
    assert check(expression) is True


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        ("'hello'.charAt(6) == ''", "index out of range: 6"),
        ("'hello'.indexOf('l', -1) == 2", "index out of range: -1"),
        ("'tacocat'.substring(4, 3) == ''", "out of range"),
        ("'tacocat'.substring(40) == ''", "out of range"),
        ("[1].join() == ''", "list of strings"),
        ("(1).lowerAscii() == ''", "needs a string"),
    ],
)
def test_string_extension_errors_are_runtime_errors(expression: str, fragment: str) -> None:
    result = check(expression)
    assert isinstance(result, CelError) and result.kind is CelErrorKind.RUNTIME
    assert fragment in result.detail


def test_too_long_expression_is_refused_before_parsing() -> None:
    expression = "true && " * (MAX_EXPRESSION_LENGTH // 8) + "true"
    result = compile_selector(expression)
    assert isinstance(result, CelError)
    assert result.kind is CelErrorKind.TOO_LONG


def test_results_are_shared_between_devices_differing_only_in_unread_facts() -> None:
    evaluator = SelectorEvaluator()
    expression = 'device.attributes["mig.carve.dev"].profile == "3g.40gb"'
    for i in range(50):
        assert evaluator.matches(expression, mig_device(uuid=f"GPU-{i}")) is True
    assert evaluator.evaluations == 1
    assert evaluator.matches(expression, mig_device(profile="1g.10gb")) is False
    assert evaluator.evaluations == 2


def test_selector_reading_per_device_facts_is_evaluated_per_device() -> None:
    evaluator = SelectorEvaluator()
    expression = 'device.attributes["mig.carve.dev"].parentUUID == "GPU-7"'
    results = [evaluator.matches(expression, mig_device(uuid=f"GPU-{i}")) for i in range(10)]
    assert results == [i == 7 for i in range(10)]
    assert evaluator.evaluations == 10


def test_selector_iterating_a_map_sees_every_fact() -> None:
    # size() depends on attributes the source never names, so no projection may happen.
    evaluator = SelectorEvaluator()
    expression = 'size(device.attributes["mig.carve.dev"]) == 7'
    assert evaluator.matches(expression, mig_device()) is True
    assert evaluate(compile_selector_ok(expression), mig_device()) is True


def compile_selector_ok(expression: str):  # type: ignore[no-untyped-def]
    compiled = compile_selector(expression)
    assert not isinstance(compiled, CelError)
    return compiled


def test_unqualified_names_belong_to_the_driver_domain() -> None:
    device = CelDevice.of(DRIVER, {"type": "gpu", "example.com/x": 1})
    assert device.attribute("mig.carve.dev/type") == "gpu"
    assert device.attribute("example.com/x") == 1


@given(st.integers(min_value=0, max_value=2**50), st.integers(min_value=0, max_value=2**50))
def test_quantity_compare_agrees_with_integers(a: int, b: int) -> None:
    expression = f'quantity("{a}").compareTo(quantity("{b}")) == {(a > b) - (a < b)}'
    assert check(expression) is True


@given(
    st.tuples(*[st.integers(min_value=0, max_value=30)] * 3),
    st.tuples(*[st.integers(min_value=0, max_value=30)] * 3),
)
def test_semver_order_agrees_with_tuples(a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    va, vb = ".".join(map(str, a)), ".".join(map(str, b))
    assert check(f'semver("{va}").isLessThan(semver("{vb}"))') is (a < b)
    assert (Semver.parse(va) < Semver.parse(vb)) is (a < b)
