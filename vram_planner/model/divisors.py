"""Divisors of a whole number in time that does not grow with it: the micro-batches a batch can be split into.

The standard library cannot factor, and sympy (which can) is neither a dependency nor quick to import, so this is
the textbook method: Miller-Rabin to recognise primes, Pollard's rho (Brent's variant) to split the rest.
"""

from __future__ import annotations

import math
from collections import Counter

# Miller-Rabin with these bases is exact below 3.3e24 (Sorenson and Webster 2015); above, only numbers built to
# fool exactly these bases pass, and all that costs is a few missed divisors.
_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
# Pollard's rho finds a factor p in about sqrt(p) steps: this finds factors up to about 2**30 and bounds the time
# (about 0.1 s) on numbers whose smallest factor is larger, which then count as one factor. Only divisors of more
# than 2**30 can be missed that way, and no micro-batch of that many sequences fits a card.
_RHO_STEPS = 2**15


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """Every divisor of n >= 1 (up to `at_most`), largest first."""
    limit = n if at_most is None else at_most
    found = [1]
    for prime, power in prime_factors(n).items():
        found = [d * prime**k for d in found for k in range(power + 1) if d * prime**k <= limit]
    return sorted(found, reverse=True)


def prime_factors(n: int) -> Counter[int]:
    """n >= 1 as {prime: exponent}."""
    factors: Counter[int] = Counter()
    for prime in _BASES:
        while n % prime == 0:
            factors[prime] += 1
            n //= prime
    unsplit = [n] if n > 1 else []
    while unsplit:
        m = unsplit.pop()
        factor = None if _is_probable_prime(m) else _rho_factor(m)
        if factor is None:
            factors[m] += 1
        else:
            unsplit += [factor, m // factor]
    return factors


def _is_probable_prime(n: int) -> bool:
    """Miller-Rabin for n > 1 without factors among the bases."""
    odd, twos = n - 1, 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    for base in _BASES:
        x = pow(base, odd, n)
        if x in (1, n - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return n > 1


def _rho_factor(n: int) -> int | None:
    """A factor 1 < f < n of the composite n (Pollard's rho, Brent's cycle finding), or None within the budget."""
    root = math.isqrt(n)
    if root * root == n:  # a batch squared: rho is slowest on equal factors
        return root
    for c in (1, 3, 5, 7):  # another polynomial when the cycle closed without splitting n
        found = _rho_brent(n, c)
        if found != n:
            return found
    return None


def _rho_brent(n: int, c: int) -> int | None:
    y, length, product, found = 2, 1, 1, 1
    x = saved = y
    while found == 1 and length <= _RHO_STEPS:
        x = y
        for _ in range(length):
            y = (y * y + c) % n
        done = 0
        while done < length and found == 1:
            saved = y
            for _ in range(min(128, length - done)):
                y = (y * y + c) % n
                product = product * abs(x - y) % n
            found = math.gcd(product, n)
            done += 128
        length *= 2
    if found == n:  # the batch of 128 overshot: step through it one at a time
        found = 1
        while found == 1:
            saved = (saved * saved + c) % n
            found = math.gcd(abs(x - saved), n)
    return None if found == 1 else found  # n itself: the cycle closed without a factor
