"""Drafts for speculative decoding from a generation's own context (prompt lookup): the tokens that followed the
latest earlier occurrence of the context's last few tokens. A reply that quotes its prompt or repeats itself
(an edited text, code, JSON) continues as before more often than not; the engine checks a draft in one step of
several tokens and keeps what the model would have chosen anyway (`Engine._generate`).

A step of 2 tokens costs more than one of 1 (1.2-1.3x, SmolLM2 on 1-2 threads; of 4 tokens 2.1-2.6x), so a
generation drafts only while its drafts have been right often enough: every draft's first token is scored
against the token the model chose, checked or not (`Drafter`). Replayed on greedy replies of SmolLM2 to eight
tasks with those costs, the gates below kept every reply at >= 1.00x and gained up to 1.5x on one thread
(docs/benchmarks-history.md)."""

SPECULATE = 3   # draft tokens a decode step checks at most, by default (`Engine(speculate=)`)
NGRAM = (3, 2)  # suffix lengths matched, longest first: a single token repeats by chance too often to pay
DRAFT_FROM, WHOLE_FROM = 0.4, 0.8  # the share of first tokens right that a draft needs, one longer than a token
LUCK = 0.2      # the weight of the latest guess in that share (an exponential average, from 0.5)


class PromptLookup:
    def __init__(self, tokens, ngram=NGRAM):
        self.ngram, self.tokens, self.after = ngram, [], {}  # after: n-gram -> index of what followed it last
        for t in tokens:
            self.push(t)

    def push(self, token):
        """Append a token of the context."""
        self.tokens.append(token)
        end = len(self.tokens) - 1  # the n-grams ending just before it are followed by it
        for n in self.ngram:
            if end >= n:
                self.after[tuple(self.tokens[end - n:end])] = end

    def draft(self, k):
        """k tokens that followed the context's last n tokens before (the longest n that occurred), or none. A
        match that runs into the present repeats its period: a loop drafts whole."""
        tokens = self.tokens
        for n in self.ngram:
            at = self.after.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if at is not None:
                out = []
                for j in range(at, at + k):
                    out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                return out
        return []


class Drafter:
    """A generation's drafts: its context's continuation (`PromptLookup`), as long as its luck so far pays."""

    def __init__(self, tokens, most):
        self.lookup, self.most, self.ahead = PromptLookup(tokens), most, most
        self.right, self.guess = 0.5, None  # the share of guesses right; the latest draft's first token

    def push(self, token):
        """A token of the reply: the guess before it scored, then the context."""
        if self.guess is not None:
            self.right += LUCK * ((token == self.guess) - self.right)
            self.guess = None
        self.lookup.push(token)

    def draft(self, room):
        """The draft for the next step (at most room tokens), or none where drafts have missed too often."""
        found = self.lookup.draft(self.most)
        self.guess = found[0] if found else None
        if self.right < DRAFT_FROM:
            return []
        return found[:min(room, self.ahead if self.right >= WHOLE_FROM else 1)]

    def checked(self, drafted, kept):
        """A step checked `drafted` tokens and the reply kept `kept`: one more next time after a whole draft, one
        fewer after a miss."""
        if drafted:
            self.ahead = min(self.most, self.ahead + 1) if kept == drafted else max(1, self.ahead - 1)
