/**
 * One exchange a gateway served, and the record of it the monitor receives (docs/tap-protocol.md,
 * "The record"): sizes, usage, timings, names, the answer's marker-shaped strings, keyed prints.
 * No text leaves the gateway.
 */

import { createHmac, randomBytes } from "node:crypto";

import { Fingerprinter, MAX_TOKENS, OWN } from "./fingerprints.js";
import { codePointLength, cut, scalars, utf8Length } from "./text.js";
import {
  CALLER_KINDS,
  type CallerKind,
  MAX_COUNT,
  MAX_FINGERPRINTS,
  MAX_MARKERS,
  MAX_MESSAGES,
  MAX_SECONDS,
  MAX_TIME,
  markersOf,
  printableName,
} from "./wire.js";

/** The gateway refused the request before any upstream call: its admission guard or its quarantine. */
export interface Refusal {
  by: "admission" | "quarantine";
  /** Admission: the sure lower bound of the prompt's tokens, and the pool it was over. */
  tokens?: number | null;
  kvPoolTokens?: number | null;
  /** Quarantine: the incident that put the deployment on (a safe integer). */
  incidentId?: number | null;
}

/** One request and its response as the gateway saw them; the texts as parts, joined by newlines. */
export interface Exchange {
  /** The response's own id (the engine's): the record's `upstream_id`, data only. */
  upstreamId?: string;
  /** Epoch seconds the request started. */
  started?: number;
  caller?: string;
  callerKind?: string;
  /** The caller's key as the gateway holds it (a key, or its SHA-256): sent as a digest only. */
  key?: string;
  apiBase?: string;
  model?: string;
  modelGroup?: string;
  stream?: boolean;
  status?: number;
  finishReason?: string | null;
  latencySeconds?: number | null;
  ttftSeconds?: number | null;
  prompt: readonly string[];
  messages: number;
  response: readonly string[];
  promptTokens?: number | null;
  completionTokens?: number | null;
  cachedTokens?: number | null;
  refused?: Refusal | null;
}

/** A record as the wire writes it, its keys in the protocol's order. */
export type TrafficRecord = Record<string, unknown>;

const HEX64 = /^[0-9A-Fa-f]{64}$/;
const JWT_PREFIX = "hashed-jwt-";
const BLANKS = /^[ \t\n\v\f\r]+|[ \t\n\v\f\r]+$/g;

/**
 * Return a caller's key as the record carries it: ASCII blanks trimmed, a `hashed-jwt-` prefix
 * (any ASCII case) dropped; 64 hex digits lower-cased; empty as empty; anything else (a key) as
 * HMAC-SHA256 under the tap's key of its UTF-8 bytes, case kept, in hex.
 */
export function keyDigest(value: string, key: Uint8Array): string {
  let text = value.replace(BLANKS, "");
  if (text.slice(0, JWT_PREFIX.length).toLowerCase() === JWT_PREFIX) text = text.slice(JWT_PREFIX.length);
  if (!text || HEX64.test(text)) return text.toLowerCase();
  return createHmac("sha256", key).update(scalars(text), "utf8").digest("hex");
}

/** Return a new record's identity: `tap-` and 24 random hex digits, once per exchange. */
export function recordId(): string {
  return `tap-${randomBytes(12).toString("hex")}`;
}

function count(value: unknown, most = MAX_COUNT): number | null {
  return typeof value === "number" && Number.isSafeInteger(value) && value >= 0 && value <= most ? value : null;
}

function seconds(value: unknown): number | null {
  return typeof value === "number" && Number.isFinite(value) && value >= 0 && value <= MAX_SECONDS ? value : null;
}

function epoch(value: unknown): number {
  return typeof value === "number" && Number.isFinite(value) && value >= 0 && value <= MAX_TIME ? value : 0;
}

/** The sizes and the read texts of an exchange: joined by newlines, read as scalar values. */
export interface Bounded {
  prompt: string;
  response: string;
  promptChars: number;
  promptBytes: number;
  responseChars: number;
}

/** Return the exchange's texts joined (as scalar values), their sizes, and what of them is read. */
export function bounded(exchange: Exchange): Bounded {
  const prompt = scalars(exchange.prompt.join("\n"));
  const response = scalars(exchange.response.join("\n"));
  return {
    prompt: cut(prompt),
    response: cut(response),
    promptChars: codePointLength(prompt),
    promptBytes: utf8Length(prompt),
    responseChars: codePointLength(response),
  };
}

/** Return the record of `exchange`: everything the monitor judges, and no text. */
export function summarize(exchange: Exchange, fingerprinter: Fingerprinter, id: string = recordId()): TrafficRecord {
  const sizes = bounded(exchange);
  const refused = exchange.refused ?? null;
  // No engine saw a refused request: nothing of it can come back from one, so no prints.
  const prompt = refused ? "" : sizes.prompt;
  const response = refused ? "" : sizes.response;
  const everyPrompt = fingerprinter.fingerprints(prompt, null);
  const whole = prompt ? [fingerprinter.whole(prompt)] : [];
  const publicPrints = fingerprinter.public;
  const privatePrints = everyPrompt.prints.filter((p) => !publicPrints.has(p));
  const promptPrints = [...whole, ...privatePrints].slice(0, MAX_FINGERPRINTS);
  const answer = fingerprinter.fingerprints(response);
  const own = new Set(everyPrompt.prints);
  const responsePrints = answer.prints.map((p) => (own.has(p) || publicPrints.has(p) ? OWN : p));
  const asked = fingerprinter.tokens(prompt);
  const askedSet = new Set(asked);
  let askedSent = asked.slice(0, MAX_TOKENS);
  let said = fingerprinter.tokens(response).filter((t) => !askedSet.has(t)).slice(0, MAX_TOKENS);
  if (fingerprinter.publicTokens.size) {
    askedSent = askedSent.filter((t) => !fingerprinter.publicTokens.has(t));
    said = said.filter((t) => !fingerprinter.publicTokens.has(t));
  }
  const markers = [...new Set(markersOf(response))].slice(0, MAX_MARKERS);
  const status =
    typeof exchange.status === "number" && Number.isInteger(exchange.status) && exchange.status >= 100 && exchange.status <= 599
      ? exchange.status
      : exchange.status === undefined
        ? 200
        : 500;
  const callerKind = (CALLER_KINDS as readonly string[]).includes(exchange.callerKind ?? "")
    ? (exchange.callerKind as CallerKind)
    : "unknown";
  const record: TrafficRecord = {
    id,
    upstream_id: printableName(exchange.upstreamId ?? ""),
    time: epoch(exchange.started),
    // A caller named by its key is named by the key's digest: never by a key.
    caller: exchange.callerKind === "key_hash" ? keyDigest(exchange.caller ?? "", fingerprinter.key) : printableName(exchange.caller ?? ""),
    caller_kind: callerKind,
    key_hash: exchange.key ? keyDigest(exchange.key, fingerprinter.key) : "",
    api_base: printableName(exchange.apiBase ?? ""),
    model: printableName(exchange.model ?? ""),
    model_group: printableName(exchange.modelGroup ?? ""),
    stream: Boolean(exchange.stream),
    status,
    finish_reason: printableName(exchange.finishReason ?? "") || null,
    latency_seconds: seconds(exchange.latencySeconds),
    ttft_seconds: seconds(exchange.ttftSeconds),
    prompt: {
      chars: sizes.promptChars,
      bytes: sizes.promptBytes,
      messages: Math.min(Math.max(Math.trunc(exchange.messages) || 0, 0), MAX_MESSAGES),
    },
    response_chars: sizes.responseChars,
    usage: {
      prompt_tokens: count(exchange.promptTokens),
      completion_tokens: count(exchange.completionTokens),
      cached_tokens: count(exchange.cachedTokens),
    },
    markers,
    fingerprints: { prompt: promptPrints, response: responsePrints },
    distinctive: { prompt: askedSent, response: said },
    truncated: everyPrompt.truncated || answer.truncated || whole.length + everyPrompt.prints.length > MAX_FINGERPRINTS,
  };
  if (refused) {
    record.refused = {
      by: refused.by,
      tokens: count(refused.tokens),
      kv_pool_tokens: count(refused.kvPoolTokens),
      incident_id: count(refused.incidentId, Number.MAX_SAFE_INTEGER),
    };
  }
  return record;
}
