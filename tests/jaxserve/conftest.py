"""These tests run jax: ask for its CPU devices before any test module here is imported."""

from tests.conftest import use_jax

use_jax()
