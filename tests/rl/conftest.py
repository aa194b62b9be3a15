"""Fixtures shared by the RL tests."""

import jax
import pytest

from configs import models
from model.config import ModelConfig
from model.transformer import Model


@pytest.fixture(scope="session")
def small_lm():
    """(model, variables): the test preset cut to one KDA layer (d_model 32, dense SwiGLU FFN,
    no MoE, no MTP), for tests whose subject is the sampler or the train step rather than the
    architecture; its programs compile in about half the test preset's time."""
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.d_model = 1, "K", 32
    c.moe.num_experts, c.moe.dense_dim, c.mtp.depth = 0, 32, 0
    model = Model(ModelConfig.from_dict(c))
    return model, model.init(jax.random.key(0))
