/**
 * How the tap reads a text (docs/tap-protocol.md, "Reading a text"): code points (a lone
 * surrogate read as U+FFFD), the head and tail of a long text, words (runs of code points that are
 * not separators), and lower case (the simple lowercase mapping within a few ranges). No rule
 * leans on this runtime's Unicode version but the case table, which is built from it and held to
 * the vectors' own (tests/fixtures/wire/unicode.json).
 */

/** Code points that are no word's (inclusive ranges, in order). */
export const SEPARATOR_RANGES: readonly (readonly [number, number])[] = [
  [0x0000, 0x002f], [0x003a, 0x0040], [0x005b, 0x005e], [0x0060, 0x0060], [0x007b, 0x00bf],
  [0x00d7, 0x00d7], [0x00f7, 0x00f7], [0x037e, 0x037e], [0x0387, 0x0387], [0x055a, 0x055f],
  [0x0589, 0x058a], [0x05be, 0x05be], [0x05c0, 0x05c0], [0x05c3, 0x05c3], [0x05c6, 0x05c6],
  [0x05f3, 0x05f4], [0x0600, 0x060f], [0x061b, 0x061f], [0x066a, 0x066d], [0x06d4, 0x06d4],
  [0x06dd, 0x06de], [0x0964, 0x0965], [0x0970, 0x0970], [0x0e3f, 0x0e3f], [0x0e4f, 0x0e4f],
  [0x0e5a, 0x0e5b], [0x10fb, 0x10fb], [0x1360, 0x1368], [0x1680, 0x1680], [0x169b, 0x169c],
  [0x16eb, 0x16ed], [0x17d4, 0x17d6], [0x17d8, 0x17db], [0x1800, 0x180a], [0x180e, 0x180e],
  [0x2000, 0x206f], [0x20a0, 0x20cf], [0x2190, 0x2bff], [0x2e00, 0x2e7f], [0x3000, 0x3004],
  [0x3008, 0x3020], [0x3030, 0x3030], [0x303d, 0x303f], [0xfd3e, 0xfd3f], [0xfe00, 0xfe19],
  [0xfe30, 0xfe6f], [0xfeff, 0xfeff], [0xff01, 0xff0f], [0xff1a, 0xff20], [0xff3b, 0xff40],
  [0xff5b, 0xff65], [0xfff0, 0xffff], [0x1f000, 0x1fbff], [0xe0000, 0xe007f],
];

/** Code points lower-cased by their simple lowercase mapping (inclusive ranges). */
export const CASE_RANGES: readonly (readonly [number, number])[] = [
  [0x0041, 0x024f], [0x0370, 0x052f], [0x0531, 0x0556], [0x1e00, 0x1fff], [0x2100, 0x218f],
  [0xff21, 0xff3a],
];

/** İ's simple mapping (the full one adds a combining dot), and the final sigma read as the sigma. */
export const EXTRA_LOWER: ReadonlyMap<number, number> = new Map([
  [0x0130, 0x0069],
  [0x03c2, 0x03c3],
]);

/** Code points of a text read whole; a longer one is read as its head, a space and its tail. */
export const MAX_TEXT_CHARS = 65_536;

function lowercaseTable(): Map<number, number> {
  const table = new Map<number, number>();
  for (const [first, last] of CASE_RANGES) {
    for (let code = first; code <= last; code++) {
      // One code point, without context: the simple mapping (no final sigma: no letter before it).
      const lowered = String.fromCodePoint(code).toLowerCase();
      const point = lowered.codePointAt(0)!;
      if (lowered.length === String.fromCodePoint(point).length && point !== code) table.set(code, point);
    }
  }
  for (const [from, to] of EXTRA_LOWER) table.set(from, to);
  return table;
}

/** Every change the lower-case rule makes. */
export const LOWERCASE: ReadonlyMap<number, number> = lowercaseTable();

const separatorBmp = new Uint8Array(0x10000);
for (const [first, last] of SEPARATOR_RANGES) {
  for (let code = first; code <= Math.min(last, 0xffff); code++) separatorBmp[code] = 1;
}

/** Whether the code point `code` is no word's. */
export function isSeparator(code: number): boolean {
  if (code <= 0xffff) return separatorBmp[code] === 1;
  return (code >= 0x1f000 && code <= 0x1fbff) || (code >= 0xe0000 && code <= 0xe007f);
}

/** Return `text` with each lone surrogate read as U+FFFD: Unicode scalar values, as UTF-8 writes. */
export function scalars(text: string): string {
  return text.isWellFormed() ? text : text.toWellFormed();
}

/** Return the code points of `text` (a well-formed string: {@link scalars}). */
export function codePointLength(text: string): number {
  let count = text.length;
  for (let i = 0; i < text.length; i++) {
    const unit = text.charCodeAt(i);
    if (unit >= 0xd800 && unit <= 0xdbff && i + 1 < text.length) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next <= 0xdfff) {
        count--;
        i++;
      }
    }
  }
  return count;
}

/** Return the UTF-16 index after the first `count` code points of `text` (well-formed). */
function indexAfter(text: string, count: number): number {
  let i = 0;
  for (let n = 0; n < count && i < text.length; n++) {
    const unit = text.charCodeAt(i);
    i += unit >= 0xd800 && unit <= 0xdbff ? 2 : 1;
  }
  return i;
}

/** Return the UTF-16 index where the last `count` code points of `text` (well-formed) begin. */
function indexOfLast(text: string, count: number): number {
  let i = text.length;
  for (let n = 0; n < count && i > 0; n++) {
    const unit = text.charCodeAt(i - 1);
    i -= unit >= 0xdc00 && unit <= 0xdfff ? 2 : 1;
  }
  return i;
}

/** Return what of a well-formed `text` is read: all of it, or its first and last 32,768 code points
 * with a space between (a text over {@link MAX_TEXT_CHARS} code points). */
export function cut(text: string): string {
  if (text.length <= MAX_TEXT_CHARS || codePointLength(text) <= MAX_TEXT_CHARS) return text;
  const half = MAX_TEXT_CHARS / 2;
  return `${text.slice(0, indexAfter(text, half))} ${text.slice(indexOfLast(text, half))}`;
}

/** Return the words of a well-formed `text`, case kept, in order. */
export function words(text: string): string[] {
  const found: string[] = [];
  let start = -1;
  for (let i = 0; i < text.length; ) {
    const code = text.codePointAt(i)!;
    const size = code > 0xffff ? 2 : 1;
    if (isSeparator(code)) {
      if (start >= 0) found.push(text.slice(start, i));
      start = -1;
    } else if (start < 0) {
      start = i;
    }
    i += size;
  }
  if (start >= 0) found.push(text.slice(start));
  return found;
}

/** Return `text` lower-cased by the protocol's rule. */
export function lower(text: string): string {
  let ascii = true;
  for (let i = 0; i < text.length; i++) {
    if (text.charCodeAt(i) > 0x7f) {
      ascii = false;
      break;
    }
  }
  if (ascii) return text.toLowerCase();
  let out = "";
  for (const char of text) {
    const mapped = LOWERCASE.get(char.codePointAt(0)!);
    out += mapped === undefined ? char : String.fromCodePoint(mapped);
  }
  return out;
}

const encoder = new TextEncoder();

/** Return the UTF-8 bytes of `text`, a lone surrogate as U+FFFD's. */
export function utf8(text: string): Uint8Array {
  return encoder.encode(text);
}

/** Return how many UTF-8 bytes `text` takes, a lone surrogate as U+FFFD's three. */
export function utf8Length(text: string): number {
  let bytes = 0;
  for (let i = 0; i < text.length; i++) {
    const unit = text.charCodeAt(i);
    if (unit < 0x80) bytes += 1;
    else if (unit < 0x800) bytes += 2;
    else if (unit >= 0xd800 && unit <= 0xdbff && i + 1 < text.length) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next <= 0xdfff) {
        bytes += 4;
        i++;
      } else bytes += 3;
    } else bytes += 3;
  }
  return bytes;
}
