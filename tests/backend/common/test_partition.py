"""`apply_partitioned`: one part of a list handled one way, the rest another, in the list's order."""

from keras_strategies.backend.common.partition import apply_partitioned


def test_each_part_is_handled_by_its_function_and_the_order_is_kept():
    calls = []

    def tag(name):
        def fn(values):
            calls.append((name, list(values)))
            return [f"{name}:{v}" for v in values]
        return fn

    result = apply_partitioned([1, 2, 3, 4, 5], lambda v: v % 2 == 0, tag("even"), tag("odd"))
    assert result == ["odd:1", "even:2", "odd:3", "even:4", "odd:5"]
    assert calls == [("even", [2, 4]), ("odd", [1, 3, 5])]  # the special part first, every time


def test_an_empty_part_is_not_passed():
    called = []
    assert apply_partitioned([1, 3], lambda v: v % 2 == 0, lambda vs: called.append(vs) or vs, lambda vs: vs) == [1, 3]
    assert called == []
    assert apply_partitioned([], bool, list, list) == []
