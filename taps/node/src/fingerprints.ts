/**
 * Keyed prints of texts (docs/tap-protocol.md, "Fingerprints" and "Distinctive tokens"): what
 * lets the monitor see that two callers' texts overlap, or that an answer names another caller's
 * names and figures, without ever holding a text. The key is the gateway's secret, the same on
 * every replica; the monitor never has it.
 */

import { Blake2b, bigEndian64 } from "./blake2b.js";
import { MAX_TEXT_CHARS, codePointLength, cut, lower, scalars, utf8, words } from "./text.js";
import { MAX_FINGERPRINTS } from "./wire.js";

export const NGRAM = 8;
export const SAMPLE_BITS = 2;
export const FINGERPRINT_BITS = 51;
/** Stands in an answer's list for a print of the caller's own prompt, or of a public text. */
export const OWN = 0;
/** Distinctive tokens: their least length, the least digits of a number, the most sent a side. */
export const MIN_CHARS = 3;
export const MIN_DIGITS = 4;
export const MAX_TOKENS = 256;
/** Public texts are read in pieces of this many code points that overlap by so many. */
export const PIECE_OVERLAP_CHARS = 1024;

const MOD = (1n << 64n) - 1n;
const BASE = 0x100000001b3n;
const GOLDEN = 0x9e3779b97f4a7c15n;
const OUT = (1n << BigInt(FINGERPRINT_BITS)) - 1n;
const SAMPLE = (1n << BigInt(SAMPLE_BITS)) - 1n;
let top = 1n;
for (let i = 0; i < NGRAM - 1; i++) top = (top * BASE) & MOD;
const TOP = top;
/** Distinct words whose hash is remembered (natural text repeats a few thousand). */
const WORD_CACHE = 50_000;

const ASCII_DIGITS = /^[0-9]+$/;
const DIGIT_OR_UNDERSCORE = /[0-9_]/;
const LOWER_ASCII_LETTERS = /^[a-z]+$/;

export interface Prints {
  prints: number[];
  /** Only part of the text was read (head and tail), or the kept prints reached the cap. */
  truncated: boolean;
}

function masked(digest: Uint8Array): number {
  return Number(bigEndian64(digest) & OUT) || 1;
}

/** Return the distinct distinctive tokens of `text` (as read: head and tail), lower-cased, in order. */
export function distinctiveWords(text: string): string[] {
  const found = new Set<string>();
  for (const word of words(cut(scalars(text)))) {
    if (codePointLength(word) < MIN_CHARS || LOWER_ASCII_LETTERS.test(word)) continue;
    if (ASCII_DIGITS.test(word)) {
      if (word.length >= MIN_DIGITS) found.add(word);
      continue;
    }
    const lowered = lower(word);
    if (lowered !== word || DIGIT_OR_UNDERSCORE.test(word)) found.add(lowered);
  }
  return [...found];
}

/** Prints texts under one key (16 bytes or more; the first 64 are used). */
export class Fingerprinter {
  readonly key: Uint8Array;
  /** Prints of the texts the gateway declared public, and of their distinctive tokens. */
  public: ReadonlySet<number> = new Set();
  publicTokens: ReadonlySet<number> = new Set();
  private readonly wordHash: Blake2b;
  private readonly wholeHash: Blake2b;
  private readonly tokenHash: Blake2b;
  private readonly cache = new Map<string, bigint>();

  constructor(key: Uint8Array) {
    if (key.length < 16) throw new RangeError("a fingerprint key needs at least 16 bytes");
    this.key = key.slice(0, 64);
    this.wordHash = new Blake2b({ key: this.key, digestSize: 8 });
    this.wholeHash = new Blake2b({ key: this.key, digestSize: 8, person: utf8("kvc-whole") });
    this.tokenHash = new Blake2b({ key: this.key, digestSize: 8, person: utf8("kvc-token") });
  }

  /** Return the kept prints of `text`, in order (at most `cap`; null: all). */
  fingerprints(text: string, cap: number | null = MAX_FINGERPRINTS): Prints {
    const whole = scalars(text);
    const truncated = whole.length > MAX_TEXT_CHARS && codePointLength(whole) > MAX_TEXT_CHARS;
    const hashes = words(lower(cut(whole))).map((w) => this.word(w));
    const prints: number[] = [];
    if (hashes.length < NGRAM) return { prints, truncated };
    let gram = 0n;
    for (let i = 0; i < NGRAM; i++) gram = (gram * BASE + hashes[i]!) & MOD;
    for (let i = NGRAM; i <= hashes.length; i++) {
      const mixed = ((gram * GOLDEN) & MOD) >> 11n;
      if ((mixed & SAMPLE) === 0n) {
        prints.push(Number((mixed >> BigInt(SAMPLE_BITS)) & OUT) || 1);
        if (cap !== null && prints.length >= cap) return { prints, truncated: true };
      }
      if (i < hashes.length) gram = ((gram - hashes[i - NGRAM]! * TOP) * BASE + hashes[i]!) & MOD;
    }
    return { prints, truncated };
  }

  /** Return the print of the whole of `text` as read (head and tail). */
  whole(text: string): number {
    return masked(this.wholeHash.digest(utf8(cut(scalars(text)))));
  }

  /** Return the print of one lower-cased distinctive token. */
  token(word: string): number {
    return masked(this.tokenHash.digest(utf8(word)));
  }

  /** Return the prints of every distinctive token of `text`, in order (no cap). */
  tokens(text: string): number[] {
    return distinctiveWords(text).map((w) => this.token(w));
  }

  /** Make the texts given public: their prints are no caller's (read whole, in overlapping pieces). */
  tellPublic(texts: Iterable<string>): void {
    const prints = new Set<number>();
    const tokens = new Set<number>();
    const step = MAX_TEXT_CHARS - PIECE_OVERLAP_CHARS;
    for (const text of texts) {
      const points = Array.from(scalars(text));
      for (let at = 0; at < Math.max(points.length - PIECE_OVERLAP_CHARS, 1); at += step) {
        const piece = points.slice(at, at + MAX_TEXT_CHARS).join("");
        for (const p of this.fingerprints(piece, null).prints) prints.add(p);
        for (const t of this.tokens(piece)) tokens.add(t);
      }
    }
    this.public = prints;
    this.publicTokens = tokens;
  }

  private word(word: string): bigint {
    let found = this.cache.get(word);
    if (found === undefined) {
      found = bigEndian64(this.wordHash.digest(utf8(word)));
      if (this.cache.size >= WORD_CACHE) this.cache.clear();
      this.cache.set(word, found);
    }
    return found;
  }
}
