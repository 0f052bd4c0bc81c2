/**
 * kvcanary's gateway tap for Node gateways: per-request summaries and keyed prints for the
 * monitor, never text (tap protocol version 4, docs/tap-protocol.md). A gateway hands it each
 * exchange once answered: the request body, the response body (or a stream's chunks or events),
 * and what it knows of who asked and which deployment answered. Nothing it does can fail or slow
 * the gateway's request: `observe` only queues.
 *
 * Configured from the environment by {@link Tap.fromEnv}, as the Python tap is:
 * `KVCANARY_TAP_URL` (the monitor, http or https), `KVCANARY_TAP_TOKEN` or `_TOKEN_FILE` (the
 * ingest token), `KVCANARY_TAP_KEY` or `_KEY_FILE` (the fingerprint key, 16 bytes or more, the
 * same on every replica and in every tap of the deployment's gateways), `KVCANARY_TAP_GATEWAY`,
 * `KVCANARY_TAP_FLUSH_SECONDS`, `KVCANARY_TAP_PUBLIC_TEXTS`.
 */

import { randomBytes } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { hostname } from "node:os";
import { join } from "node:path";

import { type GatewayFacts, exchangeOfBodies } from "./bodies.js";
import { Fingerprinter } from "./fingerprints.js";
import type { Exchange, Refusal } from "./record.js";
import { Sender, type SenderOptions } from "./sender.js";
import { GATEWAY_PATTERN } from "./wire.js";

export { assembled, answerTexts, exchangeOfBodies, promptTexts } from "./bodies.js";
export type { GatewayFacts } from "./bodies.js";
export { Blake2b, blake2b } from "./blake2b.js";
export { Fingerprinter, distinctiveWords } from "./fingerprints.js";
export { keyDigest, summarize } from "./record.js";
export type { Exchange, Refusal, TrafficRecord } from "./record.js";
export { Sender } from "./sender.js";
export * as wire from "./wire.js";

/** What a gateway hands the tap for one exchange. */
export interface Observed extends GatewayFacts {
  /** The request body as the caller sent it (chat, completions or Responses API). */
  request: unknown;
  /** The response body; or, streamed, `events`: each chunk or event's JSON, in order. */
  response?: unknown;
  events?: readonly unknown[];
  /** Set when the gateway refused the request before any upstream call. */
  refused?: Refusal;
}

export class TapConfigError extends Error {}

/** The most public text a tap reads: its prints stay in the gateway's memory. */
const MAX_PUBLIC_BYTES = 16 * 1024 * 1024;

export class Tap {
  readonly sender: Sender;
  readonly fingerprinter: Fingerprinter;

  constructor(key: Uint8Array, options: SenderOptions) {
    this.fingerprinter = new Fingerprinter(key);
    this.sender = new Sender(this.fingerprinter, options);
  }

  /** Return a tap configured from the environment; throw {@link TapConfigError} naming the variable. */
  static fromEnv(env: NodeJS.ProcessEnv = process.env, extra: Partial<SenderOptions> = {}): Tap {
    const url = (env.KVCANARY_TAP_URL ?? "").trim();
    if (!/^https?:\/\//.test(url)) {
      throw new TapConfigError("KVCANARY_TAP_URL: set it to the monitor's URL (http://host:port); this tap posts over HTTP");
    }
    const token = secret(env, "KVCANARY_TAP_TOKEN");
    if (!token) throw new TapConfigError("KVCANARY_TAP_TOKEN: set it (or KVCANARY_TAP_TOKEN_FILE) to the ingest token");
    const keyText = secret(env, "KVCANARY_TAP_KEY");
    let key: Uint8Array;
    if (keyText === null) {
      console.warn("kvcanary tap: KVCANARY_TAP_KEY is not set; fingerprints meet within this process only");
      key = randomBytes(32);
    } else {
      key = new TextEncoder().encode(keyText);
      if (key.length < 16) throw new TapConfigError("KVCANARY_TAP_KEY: the fingerprint key needs at least 16 bytes");
    }
    const gateway = (env.KVCANARY_TAP_GATEWAY ?? "").trim();
    if (gateway && !GATEWAY_PATTERN.test(gateway)) {
      throw new TapConfigError("KVCANARY_TAP_GATEWAY: up to 64 letters, digits and _.:- only");
    }
    const flush = Number((env.KVCANARY_TAP_FLUSH_SECONDS ?? "").trim() || "1");
    if (!(flush >= 0.01 && flush <= 60)) throw new TapConfigError("KVCANARY_TAP_FLUSH_SECONDS: seconds from 0.01 to 60");
    const tap = new Tap(key, {
      url,
      token,
      gateway: gateway || hostname().replace(/[^A-Za-z0-9_.:-]/g, "-").slice(0, 64),
      flushSeconds: flush,
      ...extra,
    });
    const texts = (env.KVCANARY_TAP_PUBLIC_TEXTS ?? "").trim();
    if (texts) tap.fingerprinter.tellPublic(publicTexts(texts.split(":").filter((p) => p.trim())));
    return tap;
  }

  /** Queue one exchange from its bodies; never throws, never waits. */
  observe(observed: Observed): void {
    try {
      const exchange = exchangeOfBodies(
        observed.request,
        observed.events !== undefined ? { events: observed.events } : { response: observed.response },
        observed,
      );
      this.sender.put(observed.refused ? { ...exchange, refused: observed.refused } : exchange);
    } catch (error) {
      console.warn(`kvcanary tap: cannot read an exchange (${String(error)})`);
    }
  }

  /** Queue an exchange the gateway made itself (its texts as parts); never throws. */
  observeExchange(exchange: Exchange): void {
    this.sender.put(exchange);
  }

  stats(): { sent: number; dropped: number; rejected: number; pending: number } {
    const s = this.sender;
    return { sent: s.sent, dropped: s.dropped, rejected: s.rejected, pending: s.pending };
  }

  /** Send what is queued (up to `timeoutSeconds`), then stop. */
  close(timeoutSeconds = 5): Promise<void> {
    return this.sender.close(timeoutSeconds);
  }
}

function secret(env: NodeJS.ProcessEnv, name: string): string | null {
  const path = (env[`${name}_FILE`] ?? "").trim();
  if (path) {
    let value: string;
    try {
      value = readFileSync(path, "utf8").trim();
    } catch (error) {
      throw new TapConfigError(`${name}_FILE: cannot read ${path}: ${String(error)}`);
    }
    if (!value) throw new TapConfigError(`${name}_FILE: ${path} is empty`);
    return value;
  }
  return (env[name] ?? "").trim() || null;
}

function publicTexts(paths: string[]): string[] {
  const files: string[] = [];
  const walk = (path: string): void => {
    const stat = statSync(path, { throwIfNoEntry: false });
    if (stat?.isDirectory()) for (const name of readdirSync(path).sort()) walk(join(path, name));
    else if (stat?.isFile()) files.push(path);
    else throw new TapConfigError(`KVCANARY_TAP_PUBLIC_TEXTS: ${path} is neither a file nor a folder`);
  };
  paths.forEach(walk);
  if (files.reduce((n, f) => n + statSync(f).size, 0) > MAX_PUBLIC_BYTES) {
    throw new TapConfigError(`KVCANARY_TAP_PUBLIC_TEXTS: over ${MAX_PUBLIC_BYTES} bytes of text`);
  }
  return files.map((f) => readFileSync(f, "utf8"));
}

/** Return the JSON of each `data:` line of a server-sent-events stream (`[DONE]` and others left out). */
export function sseEvents(stream: string): unknown[] {
  const events: unknown[] = [];
  for (const line of stream.split(/\r?\n/)) {
    if (!line.startsWith("data:")) continue;
    const data = line.slice(5).trim();
    if (!data || data === "[DONE]") continue;
    try {
      events.push(JSON.parse(data));
    } catch {
      // not JSON: no event of the protocol's
    }
  }
  return events;
}
