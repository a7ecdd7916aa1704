"""Small keras-hub task models built from their configs (random weights, no downloads) and their data.

Shared by the single-process tests (`tests/libraries/test_keras_hub.py`) and the two-worker
program (`keras_hub_fit.py`). Dropout is off, so that training under a strategy can equal one
device step for step; each model's batch leaves a partial last batch, which splits unevenly.
"""

import keras
import numpy as np

VOCABULARY, SEQUENCE, ROWS, BATCH = 30, 6, 14, 6  # batches of 6, 6 and 2 rows


def _text_inputs(rng, rows, segments):
    token_ids = rng.integers(1, VOCABULARY, size=(rows, SEQUENCE)).astype("int32")
    lengths = rng.integers(2, SEQUENCE + 1, size=(rows,))
    padding_mask = np.arange(SEQUENCE)[None, :] < lengths[:, None]
    token_ids = np.where(padding_mask, token_ids, 0).astype("int32")
    inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
    if segments:
        inputs["segment_ids"] = np.zeros((rows, SEQUENCE), "int32")
    return inputs


def bert_classifier():
    """A BERT-style text classifier (`BertTextClassifier` on a one-layer `BertBackbone`)."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        dropout=0.0, max_sequence_length=SEQUENCE,
    )
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(0.01))  # keras-hub's loss and metrics ("auto")
    return model


def bert_data():
    rng = np.random.default_rng(11)
    return _text_inputs(rng, ROWS, segments=True), rng.integers(0, 3, size=(ROWS,)).astype("int32"), None


def gpt2_causal_lm():
    """A GPT-2-style causal language model (`GPT2CausalLM` on a one-layer `GPT2Backbone`)."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        dropout=0.0, max_sequence_length=SEQUENCE,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(0.01))  # keras-hub's loss and weighted accuracy
    return model


def gpt2_data():
    """Next-token targets, weighted by the padding mask, as keras-hub's preprocessor makes them."""
    rng = np.random.default_rng(12)
    inputs = _text_inputs(rng, ROWS, segments=False)
    labels = np.concatenate([inputs["token_ids"][:, 1:], np.zeros((ROWS, 1), "int32")], axis=1)
    weights = np.concatenate([inputs["padding_mask"][:, 1:], np.zeros((ROWS, 1), bool)], axis=1)
    return inputs, labels, weights.astype("float32")


def resnet_classifier():
    """A ResNet image classifier (`ImageClassifier` on a one-block `ResNetBackbone`; keras-hub asks
    for 64 filters in the first stack)."""
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64],
        stackwise_num_blocks=[1], stackwise_num_strides=[1], block_type="basic_block",
        image_shape=(8, 8, 3),
    )
    model = keras_hub.models.ImageClassifier(backbone, num_classes=3, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def resnet_data():
    rng = np.random.default_rng(13)
    return rng.normal(size=(ROWS, 8, 8, 3)).astype("float32"), rng.integers(0, 3, size=(ROWS,)).astype("int32"), None


# name -> (builder, data, whether it has BatchNormalization: each replica normalizes its shard by
# its own statistics in training, as under tf.distribute, so its training equals one device only
# on one replica)
MODELS = {
    "bert_classifier": (bert_classifier, bert_data, False),
    "gpt2_causal_lm": (gpt2_causal_lm, gpt2_data, False),
    "resnet_classifier": (resnet_classifier, resnet_data, True),
}
# The model the two-worker run trains (`keras_hub_fit.py`): the others add compile time on two
# workers but no code path of ours that the single-process tests and this one do not take.
TWO_WORKER_MODELS = ("gpt2_causal_lm",)


def fit(model, data, epochs=2):
    x, y, sample_weight = data
    return model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, epochs=epochs, shuffle=False,
                     verbose=0).history


def evaluate(model, data):
    x, y, sample_weight = data
    return model.evaluate(x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0, return_dict=True)


def predict(model, data):
    return model.predict(data[0], batch_size=BATCH, verbose=0)
