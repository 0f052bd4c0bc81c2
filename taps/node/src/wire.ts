/**
 * The tap protocol's shared rules (docs/tap-protocol.md): its version, the bounds of a record and
 * a batch, the marker pattern, printable names, how numbers, strings, records and batches are
 * written as bytes, how a batch is cut into NATS messages, and a deployment's routing key and
 * partition. Every function here is checked against tests/fixtures/wire/framing.json and
 * golden.json.
 */

import { scalars } from "./text.js";
import { blake2b } from "./blake2b.js";

export const VERSION = 4;
export const SUBJECT_PREFIX = "kvcanary.traffic";
export const PARTITIONS = 16;
export const VERSION_HEADER = "Kvcanary-Version";
export const GATEWAY_HEADER = "Kvcanary-Gateway";
export const DROPPED_HEADER = "Kvcanary-Dropped";
export const RECORDS_HEADER = "Kvcanary-Records";
export const MSG_ID_HEADER = "Nats-Msg-Id";
export const MESSAGE_BYTES = 512 * 1024;
export const HEADER_BYTES = 1024;
export const MAX_DROPPED = 1_000_000;
export const MAX_RECORDS = 1000;
export const MAX_FINGERPRINTS = 1024;
export const MAX_MARKERS = 32;
export const NAME_CHARS = 200;
export const MAX_COUNT = 1e12;
export const MAX_MESSAGES = 100_000;
export const MAX_SECONDS = 7 * 86_400;
export const MAX_TIME = 2 ** 33;
export const GATEWAY_PATTERN = /^[A-Za-z0-9_.:-]{1,64}$/;
export const CALLER_KINDS = ["team", "key_alias", "key_hash", "end_user", "unknown"] as const;
export type CallerKind = (typeof CALLER_KINDS)[number];
/** A kvcanary marker: ASCII letters in either case, nothing else. */
export const MARKER_PATTERN = "[Kk][Vv][Cc]-[0-9A-Fa-f]{8}-[0-9A-Fa-f]{32}";

/** Return every marker-shaped string of `text`, leftmost first, not overlapping, in order. */
export function markersOf(text: string): string[] {
  return Array.from(text.matchAll(new RegExp(MARKER_PATTERN, "g")), (m) => m[0]);
}

// --- names ---------------------------------------------------------------------------------------

function charClass(ranges: readonly (readonly [number, number])[]): string {
  const hex = (code: number) => `\\u{${code.toString(16)}}`;
  return ranges.map(([a, b]) => (a === b ? hex(a) : `${hex(a)}-${hex(b)}`)).join("");
}

/** Unicode 17's format characters (Cf), private use (Co); controls and line/paragraph separators;
 * white space: as kvcanary/wire.py states them. */
export const FORMAT_RANGES: readonly (readonly [number, number])[] = [
  [0x00ad, 0x00ad], [0x0600, 0x0605], [0x061c, 0x061c], [0x06dd, 0x06dd], [0x070f, 0x070f],
  [0x0890, 0x0891], [0x08e2, 0x08e2], [0x180e, 0x180e], [0x200b, 0x200f], [0x202a, 0x202e],
  [0x2060, 0x2064], [0x2066, 0x206f], [0xfeff, 0xfeff], [0xfff9, 0xfffb], [0x110bd, 0x110bd],
  [0x110cd, 0x110cd], [0x13430, 0x1343f], [0x1bca0, 0x1bca3], [0x1d173, 0x1d17a],
  [0xe0001, 0xe0001], [0xe0020, 0xe007f],
];
export const PRIVATE_RANGES: readonly (readonly [number, number])[] = [
  [0xe000, 0xf8ff], [0xf0000, 0xffffd], [0x100000, 0x10fffd],
];
export const BREAK_RANGES: readonly (readonly [number, number])[] = [[0x0000, 0x001f], [0x007f, 0x009f], [0x2028, 0x2029]];
export const SPACE_RANGES: readonly (readonly [number, number])[] = [
  [0x0020, 0x0020], [0x00a0, 0x00a0], [0x1680, 0x1680], [0x2000, 0x200a], [0x202f, 0x202f],
  [0x205f, 0x205f], [0x3000, 0x3000],
];
const BREAK_RE = new RegExp(`[${charClass(BREAK_RANGES)}]`, "gu");
const HIDDEN_RE = new RegExp(`[${charClass([...FORMAT_RANGES, ...PRIVATE_RANGES])}]`, "gu");
const SPACES_RE = new RegExp(`[${charClass(SPACE_RANGES)}]+`, "gu");

/** Return the first `count` code points of `text`. */
function headCodePoints(text: string, count: number): string {
  let i = 0;
  for (let n = 0; n < count && i < text.length; n++) {
    const unit = text.charCodeAt(i);
    i += unit >= 0xd800 && unit <= 0xdbff && i + 1 < text.length ? 2 : 1;
  }
  return text.slice(0, i);
}

/**
 * Return `value` as a name a record may carry: its first 800 code points, each break a space,
 * each format, surrogate or private-use character U+FFFD, each run of white space one space, the
 * ends trimmed, then its first 200 code points less a space that ends them.
 */
export function printableName(value: unknown): string {
  const text = scalars(headCodePoints(typeof value === "string" ? value : value == null ? "" : String(value), 4 * NAME_CHARS));
  const made = text.replace(BREAK_RE, " ").replace(HIDDEN_RE, "\ufffd").replace(SPACES_RE, " ");
  return headCodePoints(trimSpaces(made), NAME_CHARS).replace(/ +$/, "");
}

function trimSpaces(text: string): string {
  return text.replace(/^ +/, "").replace(/ +$/, "");
}

// --- bytes ---------------------------------------------------------------------------------------

/** Return a duration or a time in seconds as the wire writes it: floor(x * 1e6 + 0.5) microseconds,
 * in decimal with one to six fraction digits. */
export function secondsText(value: number): string {
  if (!Number.isFinite(value)) throw new RangeError(`not a number of seconds: ${value}`);
  const micros = Math.floor(value * 1e6 + 0.5);
  const size = Math.abs(micros);
  const whole = Math.floor(size / 1e6);
  const fraction = String(size - whole * 1e6).padStart(6, "0").replace(/0+$/, "") || "0";
  return `${micros < 0 ? "-" : ""}${whole}.${fraction}`;
}

const SHORT_ESCAPES: Record<number, string> = { 0x08: "\\b", 0x09: "\\t", 0x0a: "\\n", 0x0c: "\\f", 0x0d: "\\r", 0x22: '\\"', 0x5c: "\\\\" };

/** Return `text` as a JSON string the wire writes: ASCII only, every other code unit `\uXXXX`. */
export function jsonString(text: string): string {
  const s = scalars(text);
  let out = '"';
  let run = 0;
  for (let i = 0; i < s.length; i++) {
    const unit = s.charCodeAt(i);
    if (unit >= 0x20 && unit < 0x7f && unit !== 0x22 && unit !== 0x5c) continue;
    out += s.slice(run, i) + (SHORT_ESCAPES[unit] ?? `\\u${unit.toString(16).padStart(4, "0")}`);
    run = i + 1;
  }
  return `${out}${s.slice(run)}"`;
}

/** The record's keys whose numbers are seconds; every other number is an integer. */
const SECONDS_KEYS = new Set(["time", "latency_seconds", "ttft_seconds"]);

function written(value: unknown, seconds: boolean): string {
  if (value === null || value === undefined) return "null";
  if (value === true) return "true";
  if (value === false) return "false";
  if (typeof value === "number") {
    if (seconds) return secondsText(value);
    if (!Number.isSafeInteger(value)) throw new RangeError(`the wire has no integer ${value}`);
    return String(value);
  }
  if (typeof value === "bigint") return value.toString();
  if (typeof value === "string") return jsonString(value);
  if (Array.isArray(value)) return `[${value.map((v) => written(v, false)).join(",")}]`;
  if (typeof value === "object") {
    const fields = Object.entries(value as Record<string, unknown>).map(
      ([k, v]) => `${jsonString(k)}:${written(v, SECONDS_KEYS.has(k))}`,
    );
    return `{${fields.join(",")}}`;
  }
  throw new TypeError(`the wire has no ${typeof value}`);
}

/** Return a record (or any part of one) as the wire writes it: compact JSON, keys in their order. */
export function encode(value: unknown): string {
  return written(value, false);
}

/** Return the body of `POST /api/v1/traffic` for records already written ({@link encode}). */
export function batchBody(batchId: string, gateway: string, dropped: number, records: readonly string[]): string {
  return `{"version":${VERSION},"batch":${jsonString(batchId)},"gateway":${jsonString(gateway)},"dropped":${dropped},"records":[${records.join(",")}]}`;
}

/** Return the id of half `half` of a batch refused as too large: BLAKE2b-128 of `<id>.<half>`, hex. */
export function partId(batchId: string, half: 0 | 1): string {
  return Buffer.from(blake2b(new TextEncoder().encode(`${batchId}.${half}`), { digestSize: 16 })).toString("hex");
}

// --- routing and messages ------------------------------------------------------------------------

const BLANKS = " \t\n\v\f\r";

/** Return the routing key of an `api_base`: ASCII blanks stripped, ASCII letters lower-cased,
 * trailing slashes, then one `/v1`, then trailing slashes stripped. */
export function apiBaseKey(url: string): string {
  let start = 0;
  let end = url.length;
  while (start < end && BLANKS.includes(url[start]!)) start++;
  while (end > start && BLANKS.includes(url[end - 1]!)) end--;
  let key = url.slice(start, end).replace(/[A-Z]+/g, (s) => s.toLowerCase()).replace(/\/+$/, "");
  if (key.endsWith("/v1")) key = key.slice(0, -3).replace(/\/+$/, "");
  return key;
}

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** Return CRC-32 (IEEE 802.3) of `bytes`. */
export function crc32(bytes: Uint8Array): number {
  let crc = 0xffffffff;
  for (const byte of bytes) crc = CRC_TABLE[(crc ^ byte) & 0xff]! ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

/** Return the partition of a deployment: CRC-32 of its key's UTF-8 bytes modulo `partitions`. */
export function partitionOf(apiBase: string, partitions: number): number {
  return crc32(new TextEncoder().encode(apiBaseKey(apiBase))) % partitions;
}

export interface Message {
  subject: string;
  /** ASCII: the wire writes nothing else. */
  payload: string;
  headers: Record<string, string>;
  /** The index in the batch of the message's first record. */
  first: number;
}

/** Return how many bytes a NATS server counts for `headers`, with room for the drop report. */
export function headerBytes(headers: Record<string, string>): number {
  let size = 12 + DROPPED_HEADER.length + 16;
  for (const [k, v] of Object.entries(headers)) size += k.length + v.length + 4;
  return size;
}

/** Return the most bytes a message's payload may take on a server of `maxPayload`. */
export function messageLimit(maxPayload: number): number {
  return Math.max(1, Math.min(MESSAGE_BYTES, maxPayload - HEADER_BYTES));
}

/**
 * Return a batch's records as NATS messages: a partition's records together in batch order,
 * partitions in the order of their first record, each payload `{"records":[...]}` of at most
 * `limit` bytes (a record alone over it goes alone).
 */
export function messagesOf(
  batchId: string,
  gateway: string,
  records: readonly { api_base?: unknown }[],
  partitions: number,
  prefix = SUBJECT_PREFIX,
  limit = MESSAGE_BYTES,
  encoded?: readonly string[],
): Message[] {
  const texts = encoded ?? records.map((r) => encode(r));
  const bySubject = new Map<string, number[]>();
  records.forEach((record, i) => {
    const subject = `${prefix}.${partitionOf(String(record.api_base ?? ""), partitions)}`;
    const list = bySubject.get(subject) ?? [];
    list.push(i);
    bySubject.set(subject, list);
  });
  const out: Message[] = [];
  const empty = '{"records":[]}'.length;
  for (const [subject, indexes] of bySubject) {
    const partition = subject.slice(subject.lastIndexOf(".") + 1);
    const chunks: number[][] = [[]];
    let size = empty;
    for (const i of indexes) {
      const length = texts[i]!.length;
      if (chunks.at(-1)!.length && size + 1 + length > limit) {
        chunks.push([]);
        size = empty;
      }
      size += (chunks.at(-1)!.length ? 1 : 0) + length;
      chunks.at(-1)!.push(i);
    }
    chunks.forEach((chunk, part) => {
      out.push({
        subject,
        payload: `{"records":[${chunk.map((i) => texts[i]).join(",")}]}`,
        headers: {
          [VERSION_HEADER]: String(VERSION),
          [GATEWAY_HEADER]: gateway,
          [RECORDS_HEADER]: String(chunk.length),
          [MSG_ID_HEADER]: `${batchId}.${partition}.${part}`,
        },
        first: chunk[0]!,
      });
    });
  }
  return out;
}

/** Split messages into those a server of `maxPayload` takes and those it never will, and put the
 * drop report (when not 0) on the first it takes. */
export function publishable(messages: Message[], maxPayload: number, dropped: number): [Message[], Message[]] {
  const fits = messages.filter((m) => m.payload.length + headerBytes(m.headers) <= maxPayload);
  const never = messages.filter((m) => m.payload.length + headerBytes(m.headers) > maxPayload);
  if (fits.length && dropped) fits[0]!.headers[DROPPED_HEADER] = String(dropped);
  return [fits, never];
}
