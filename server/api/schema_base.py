"""What every request schema shares: strict OpenAI-style models and valid-Unicode text."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"): not text, and the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text must be valid Unicode: unpaired surrogate U+{ord(text[exc.start]):04X} "
                         f"at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]      # every string a request may carry


class OpenAIModel(BaseModel):
    # NaN/inf are never valid numbers here; unknown fields are dropped like OpenAI does. Strict types, as
    # OpenAI's API: "yes" or "1" is not a boolean, "3" or 1.5 not an integer (an integer is still a number).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
