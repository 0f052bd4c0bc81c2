/**
 * This tap against every golden vector of the protocol (tests/fixtures/wire/*.json, written by the
 * Python tap): the same words, case, prints, records, bytes and messages of the same inputs.
 * `KVCANARY_WIRE_VECTORS` names another folder of vectors.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { Blake2b, bigEndian64 } from "../src/blake2b.js";
import { exchangeOfBodies } from "../src/bodies.js";
import { Fingerprinter, distinctiveWords } from "../src/fingerprints.js";
import { keyDigest, summarize, type Refusal } from "../src/record.js";
import { CASE_RANGES, EXTRA_LOWER, LOWERCASE, SEPARATOR_RANGES, codePointLength, cut, lower, scalars, utf8Length, words } from "../src/text.js";
import * as wire from "../src/wire.js";

type Json = Record<string, any>;

const folder = process.env.KVCANARY_WIRE_VECTORS ?? fileURLToPath(new URL("../../../../tests/fixtures/wire/", import.meta.url));

function load(name: string): Json {
  const vectors = JSON.parse(readFileSync(`${folder}/${name}`, "utf8")) as Json;
  assert.equal(vectors.version, wire.VERSION, `${name}: the protocol's version`);
  return vectors;
}

function keyOf(vectors: Json): Uint8Array {
  return Uint8Array.from(Buffer.from(vectors.key_hex as string, "hex"));
}

/** Assert every output of a text vector (golden.json's texts, unicode.json's hard cases). */
function checkText(name: string, v: Json, tap: Fingerprinter): void {
  const text = v.text as string;
  if (v.code_points_of_text) {
    assert.deepEqual([...text].map((c) => c.codePointAt(0)), v.code_points_of_text, `${name}: read as written`);
  }
  const read = words(cut(scalars(text)));
  assert.equal(codePointLength(scalars(text)), v.code_points, `${name}: code points`);
  assert.equal(utf8Length(text), v.utf8_bytes, `${name}: UTF-8 bytes`);
  if (v.words !== null) {
    assert.deepEqual(read, v.words, `${name}: words`);
    assert.deepEqual(read.map(lower), v.lowered, `${name}: lower-cased`);
  }
  const prints = tap.fingerprints(text);
  assert.deepEqual(prints.prints, v.fingerprints, `${name}: fingerprints`);
  assert.equal(prints.truncated, v.truncated, `${name}: truncated`);
  assert.equal(tap.whole(text), v.whole, `${name}: whole print`);
  assert.deepEqual(distinctiveWords(text), v.distinctive_words, `${name}: distinctive words`);
  assert.deepEqual(tap.tokens(text), v.distinctive, `${name}: distinctive prints`);
}

test("golden.json: BLAKE2b under each parameter set", () => {
  for (const v of load("golden.json").blake2b as Json[]) {
    const hash = new Blake2b({
      key: Buffer.from(v.key_hex, "hex").subarray(0, 64),
      person: new TextEncoder().encode(v.person),
      digestSize: v.digest_size,
    });
    assert.equal(Buffer.from(hash.digest(Buffer.from(v.data_hex, "hex"))).toString("hex"), v.digest_hex);
  }
  assert.equal(bigEndian64(Uint8Array.from([0, 0, 0, 0, 0, 0, 1, 2])), 258n);
});

test("golden.json: words, fingerprints, whole prints and distinctive tokens of texts", () => {
  const vectors = load("golden.json");
  const tap = new Fingerprinter(keyOf(vectors));
  for (const [name, v] of Object.entries(vectors.texts as Record<string, Json>)) checkText(name, v, tap);
  const { prompt, response, distinctive } = vectors.exchange as Json;
  const asked = tap.tokens(prompt).slice(0, 256);
  const said = tap.tokens(response).filter((t) => !asked.includes(t));
  assert.deepEqual({ prompt: asked, response: said }, distinctive);
});

test("golden.json: routing keys, partitions and key digests", () => {
  const vectors = load("golden.json");
  for (const v of vectors.api_bases as Json[]) {
    assert.equal(wire.apiBaseKey(v.url), v.key, JSON.stringify(v.url));
    assert.equal(wire.partitionOf(v.url, 16), v.partition_16);
    assert.equal(wire.partitionOf(v.url, 7), v.partition_7);
  }
  const key = new Fingerprinter(keyOf(vectors)).key;
  for (const v of vectors.key_digests as Json[]) assert.equal(keyDigest(v.value, key), v.digest, JSON.stringify(v.value));
});

test("unicode.json: the rules' tables are this tap's, and its runtime lower-cases as the table says", () => {
  const vectors = load("unicode.json");
  assert.deepEqual(SEPARATOR_RANGES, vectors.separator_ranges);
  assert.deepEqual(CASE_RANGES, vectors.case_ranges);
  assert.deepEqual([...EXTRA_LOWER], vectors.extra_lowercase);
  assert.deepEqual([...LOWERCASE].sort(([a], [b]) => a - b), vectors.lowercase);
});

test("unicode.json: the hard cases", () => {
  const vectors = load("unicode.json");
  const tap = new Fingerprinter(keyOf(vectors));
  for (const [name, v] of Object.entries(vectors.hard_cases as Record<string, Json>)) checkText(name, v, tap);
});

test("exchanges.json: whole exchanges, bodies in, the record's bytes out", () => {
  const vectors = load("exchanges.json");
  for (const v of vectors.exchanges as Json[]) {
    const tap = new Fingerprinter(keyOf(vectors));
    if (v.public_texts) tap.tellPublic(v.public_texts);
    const g = v.gateway as Json;
    const exchange = exchangeOfBodies(v.request, v.events !== undefined ? { events: v.events } : { response: v.response }, {
      started: g.time,
      caller: g.caller,
      callerKind: g.caller_kind,
      key: g.key,
      apiBase: g.api_base,
      modelGroup: g.model_group,
      status: g.status,
      latencySeconds: g.latency_seconds,
      ttftSeconds: g.ttft_seconds,
    });
    const refused: Refusal | null = g.refused
      ? { by: g.refused.by, tokens: g.refused.tokens, kvPoolTokens: g.refused.kv_pool_tokens, incidentId: g.refused.incident_id }
      : null;
    const record = summarize({ ...exchange, refused }, tap, g.record_id);
    assert.deepEqual(JSON.parse(wire.encode(record)), v.record, `${v.name}: the record`);
    assert.equal(wire.encode(record), v.encoded, `${v.name}: the record's bytes`);
  }
});

test("framing.json: numbers, strings, bodies and the 413 halves' ids", () => {
  const vectors = load("framing.json");
  for (const v of vectors.seconds as Json[]) assert.equal(wire.secondsText(v.value), v.text, String(v.value));
  for (const v of vectors.strings as Json[]) assert.equal(wire.encode(v.value), v.json, JSON.stringify(v.value));
  for (const v of vectors.bodies as Json[]) {
    const encoded = (v.records as Json[]).map((r) => wire.encode(r));
    assert.equal(wire.batchBody(v.batch_id, v.gateway, v.dropped, encoded), v.body);
  }
  for (const v of vectors.part_ids as Json[]) assert.equal(wire.partId(v.batch_id, v.half), v.id);
});

test("framing.json: NATS messages, parts, drops and a record too large", () => {
  for (const v of load("framing.json").messages as Json[]) {
    const made = wire.messagesOf(v.batch_id, v.gateway, v.records, v.partitions, v.prefix, wire.messageLimit(v.max_payload));
    const [sent, never] = wire.publishable(made, v.max_payload, v.dropped);
    assert.deepEqual(
      sent.map((m) => ({ subject: m.subject, headers: m.headers, payload: m.payload, first_record: m.first })),
      v.messages,
      v.name,
    );
    assert.deepEqual(
      never.map((m) => ({ first_record: m.first, records: Number(m.headers[wire.RECORDS_HEADER]) })),
      v.never_published,
      v.name,
    );
  }
});

test("framing.json: printable names and markers", () => {
  const vectors = load("framing.json");
  for (const v of vectors.names as Json[]) assert.equal(wire.printableName(v.value), v.name, JSON.stringify(v.value));
  for (const v of vectors.markers as Json[]) assert.deepEqual(wire.markersOf(v.text), v.markers, v.text);
});
