from driver.catalog import Engines, Placement


def test_placement_mask_covers_its_units() -> None:
    assert Placement(4, 4).mask == 0b1111_0000
    assert Placement(6, 2).end == 8


def test_engines_arithmetic_and_limits() -> None:
    a = Engines(1, 1, 0, 1, 1)
    b = Engines(3, 2, 0, 2, 0)
    assert (a + b) - b == a
    assert a.fits_within(Engines(1, 1, 0, 1, 1))
    assert not (a + a).fits_within(Engines(7, 7, 0, 7, 1))


def test_engine_counts_follow_field_order() -> None:
    assert Engines(copy=1, decoders=2, encoders=3, jpeg=4, ofa=5).counts() == (1, 2, 3, 4, 5)
