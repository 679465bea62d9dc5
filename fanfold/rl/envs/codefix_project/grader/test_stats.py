import unittest

from stats import clamp, mean, median, percent_change


class MeanTest(unittest.TestCase):
    def test_whole(self):
        self.assertEqual(mean([2, 4, 6]), 4)

    def test_fraction(self):
        self.assertAlmostEqual(mean([1, 2]), 1.5)


class MedianTest(unittest.TestCase):
    def test_odd_unsorted(self):
        self.assertEqual(median([9, 1, 5]), 5)

    def test_even_unsorted(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)


class ClampTest(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_edges(self):
        self.assertEqual((clamp(-3, 0, 10), clamp(30, 0, 10)), (0, 10))


class PercentChangeTest(unittest.TestCase):
    def test_growth(self):
        self.assertAlmostEqual(percent_change(50, 75), 50.0)

    def test_drop(self):
        self.assertAlmostEqual(percent_change(200, 150), -25.0)


if __name__ == "__main__":
    unittest.main()
