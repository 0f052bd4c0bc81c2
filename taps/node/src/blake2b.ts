/**
 * BLAKE2b (RFC 7693), written from the RFC for the tap protocol's prints: Node's `crypto` has
 * BLAKE2b-512 only, with neither a key nor a personalization nor another digest length, and the
 * protocol needs all three (docs/tap-protocol.md, "BLAKE2b").
 *
 * The parameter block: digest length (1-64), key length (0-64), fanout 1, depth 1, leaf length,
 * node offset, node depth and inner length 0, the salt 16 zero bytes, the personalization its
 * bytes padded with zero bytes to 16. A key is a block of its own before the data, padded with
 * zero bytes to 128. A digest of 8 bytes is its own, not the first 8 of a 64-byte one.
 *
 * 64-bit words are held as two 32-bit halves (low, high) in `Uint32Array`s: BigInt is some
 * twenty times slower, and a long prompt hashes ten thousand words.
 */

const IV = new Uint32Array([
  0xf3bcc908, 0x6a09e667, 0x84caa73b, 0xbb67ae85, 0xfe94f82b, 0x3c6ef372, 0x5f1d36f1, 0xa54ff53a,
  0xade682d1, 0x510e527f, 0x2b3e6c1f, 0x9b05688c, 0xfb41bd6b, 0x1f83d9ab, 0x137e2179, 0x5be0cd19,
]);

const SIGMA: readonly (readonly number[])[] = [
  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
  [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
  [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
  [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
  [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
  [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
  [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
  [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
  [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
  [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
];

/** The columns, then the diagonals, of the 4x4 working state: (a, b, c, d) word indexes. */
const MIX: readonly (readonly [number, number, number, number])[] = [
  [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15],
  [0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14],
];

const v = new Uint32Array(32);
const m = new Uint32Array(32);

/** `v[a] += v[b] + m[x]` on 64-bit words (the low half at `2i`, the high at `2i + 1`). */
function add3(a: number, b: number, x: number): void {
  const lo = v[2 * a]! + v[2 * b]! + m[2 * x]!;
  const carry = Math.floor(lo / 0x100000000);
  v[2 * a + 1] = v[2 * a + 1]! + v[2 * b + 1]! + m[2 * x + 1]! + carry;
  v[2 * a] = lo;
}

/** `v[a] += v[b]`. */
function add2(a: number, b: number): void {
  const lo = v[2 * a]! + v[2 * b]!;
  v[2 * a + 1] = v[2 * a + 1]! + v[2 * b + 1]! + (lo > 0xffffffff ? 1 : 0);
  v[2 * a] = lo;
}

/** `v[d] = rotr64(v[d] ^ v[a], n)` for the four rotations BLAKE2b uses: 32, 24, 16 and 63. */
function xorRotate(d: number, a: number, n: 32 | 24 | 16 | 63): void {
  const lo = v[2 * d]! ^ v[2 * a]!;
  const hi = v[2 * d + 1]! ^ v[2 * a + 1]!;
  if (n === 32) {
    v[2 * d] = hi;
    v[2 * d + 1] = lo;
  } else if (n === 63) {
    v[2 * d] = (lo << 1) | (hi >>> 31);
    v[2 * d + 1] = (hi << 1) | (lo >>> 31);
  } else {
    v[2 * d] = (lo >>> n) | (hi << (32 - n));
    v[2 * d + 1] = (hi >>> n) | (lo << (32 - n));
  }
}

function compress(h: Uint32Array, block: Uint8Array, offset: number, counter: number, last: boolean): void {
  for (let i = 0; i < 32; i++) {
    const at = offset + 4 * i;
    m[i] = block[at]! | (block[at + 1]! << 8) | (block[at + 2]! << 16) | (block[at + 3]! << 24);
  }
  v.set(h, 0);
  v.set(IV, 16);
  v[24] = v[24]! ^ (counter >>> 0);
  v[25] = v[25]! ^ Math.floor(counter / 0x100000000);
  if (last) {
    v[28] = ~v[28]!;
    v[29] = ~v[29]!;
  }
  for (let round = 0; round < 12; round++) {
    const s = SIGMA[round % 10]!;
    for (let i = 0; i < 8; i++) {
      const [a, b, c, d] = MIX[i]!;
      add3(a, b, s[2 * i]!);
      xorRotate(d, a, 32);
      add2(c, d);
      xorRotate(b, c, 24);
      add3(a, b, s[2 * i + 1]!);
      xorRotate(d, a, 16);
      add2(c, d);
      xorRotate(b, c, 63);
    }
  }
  for (let i = 0; i < 16; i++) h[i] = h[i]! ^ v[i]! ^ v[i + 16]!;
}

export interface Blake2bOptions {
  /** 0 to 64 bytes; none by default. */
  key?: Uint8Array;
  /** At most 16 bytes, padded with zero bytes to 16; none by default. */
  person?: Uint8Array;
  /** 1 to 64 bytes; 64 by default. */
  digestSize?: number;
}

/**
 * A BLAKE2b of fixed parameters, its key block compressed once: `digest(data)` of many short
 * inputs (a text's words) costs one compression each, not two.
 */
export class Blake2b {
  readonly digestSize: number;
  private readonly start: Uint32Array;
  private readonly keyBlock: Uint8Array | null;
  private readonly afterKey: Uint32Array | null;

  constructor(options: Blake2bOptions = {}) {
    const key = options.key ?? new Uint8Array(0);
    const person = options.person ?? new Uint8Array(0);
    this.digestSize = options.digestSize ?? 64;
    if (!(this.digestSize >= 1 && this.digestSize <= 64)) throw new RangeError("BLAKE2b: a digest of 1 to 64 bytes");
    if (key.length > 64) throw new RangeError("BLAKE2b: a key of at most 64 bytes");
    if (person.length > 16) throw new RangeError("BLAKE2b: a personalization of at most 16 bytes");
    const params = new Uint8Array(64);
    params[0] = this.digestSize;
    params[1] = key.length;
    params[2] = 1;
    params[3] = 1;
    params.set(person, 48);
    this.start = new Uint32Array(16);
    for (let i = 0; i < 16; i++) {
      const word = params[4 * i]! | (params[4 * i + 1]! << 8) | (params[4 * i + 2]! << 16) | (params[4 * i + 3]! << 24);
      this.start[i] = IV[i]! ^ word;
    }
    if (key.length) {
      this.keyBlock = new Uint8Array(128);
      this.keyBlock.set(key);
      this.afterKey = this.start.slice();
      compress(this.afterKey, this.keyBlock, 0, 128, false);
    } else {
      this.keyBlock = null;
      this.afterKey = null;
    }
  }

  /** Return the digest of `data`. */
  digest(data: Uint8Array): Uint8Array {
    let h: Uint32Array;
    let counter = 0;
    if (this.keyBlock !== null) {
      if (data.length === 0) {
        h = this.start.slice();
        compress(h, this.keyBlock, 0, 128, true);
        return this.out(h);
      }
      h = this.afterKey!.slice();
      counter = 128;
    } else {
      h = this.start.slice();
    }
    const full = data.length === 0 ? 0 : Math.floor((data.length - 1) / 128);
    for (let i = 0; i < full; i++) {
      counter += 128;
      compress(h, data, 128 * i, counter, false);
    }
    const tail = new Uint8Array(128);
    const rest = data.subarray(128 * full);
    tail.set(rest);
    counter += rest.length;
    compress(h, tail, 0, counter, true);
    return this.out(h);
  }

  private out(h: Uint32Array): Uint8Array {
    const bytes = new Uint8Array(64);
    for (let i = 0; i < 16; i++) {
      const word = h[i]!;
      bytes[4 * i] = word & 0xff;
      bytes[4 * i + 1] = (word >>> 8) & 0xff;
      bytes[4 * i + 2] = (word >>> 16) & 0xff;
      bytes[4 * i + 3] = (word >>> 24) & 0xff;
    }
    return bytes.slice(0, this.digestSize);
  }
}

/** Return BLAKE2b of `data` under `options` (one call: {@link Blake2b} for many inputs). */
export function blake2b(data: Uint8Array, options: Blake2bOptions = {}): Uint8Array {
  return new Blake2b(options).digest(data);
}

/** Return the first 8 bytes of `digest` as a big-endian unsigned 64-bit integer. */
export function bigEndian64(digest: Uint8Array): bigint {
  let value = 0n;
  for (let i = 0; i < 8; i++) value = (value << 8n) | BigInt(digest[i]!);
  return value;
}
