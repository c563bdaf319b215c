"""Chat templates: the model file's Jinja2 template rendered in a sandbox (model files are untrusted).

The environment mirrors what transformers' apply_chat_template offers templates: trim_blocks and
lstrip_blocks, loop controls, `{% generation %}` blocks, a `tojson` filter that keeps non-ASCII text,
`raise_exception` and `strftime_now`.
"""

import functools
import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import JitllmError

# Used when the model carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it just renders."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template, messages, add_generation_prompt=True, bos_token="", eos_token="", **extra):
    """Render messages ([{"role": ..., "content": ...}, ...]) with template (None = ChatML).

    extra keyword arguments (tools, documents, ...) are passed to the template as variables.
    """
    try:
        compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    except jinja2.TemplateSyntaxError as e:
        raise JitllmError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e
    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except _TemplateRaised as e:
        raise JitllmError(f"chat template rejected the conversation: {e}") from e
    except Exception as e:  # an untrusted template can fail in any way; report it, never crash the caller
        raise JitllmError(f"chat template failed to render: {type(e).__name__}: {e}") from e
