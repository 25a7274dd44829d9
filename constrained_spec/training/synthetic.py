"""Task-style structured-output prompts for drafter training: short requests, small schemas.

The drafter corpus (:mod:`.data`) draws its structured prompts from JSONSchemaBench: large,
real-world schemas with the instruction "Generate a JSON object for: <description>". Users (and
the benchmark the heads are measured on) mostly send something else: a one- or two-sentence
request ("Extract the booking from this email: ...", "Invent a podcast episode with 2 guests")
against a small hand-written schema of 3-9 properties. The target writes differently for those
(shorter strings copied from the prompt, small integers, enum values, short arrays), and a
drafter that never saw such outputs predicts them worse. This module writes such prompts.

Prompts are assembled from ~30 domains (hotel bookings, bank transactions, bug tickets, ...).
Each domain lists fields: a JSON type, a value generator and phrase templates that state a value
in prose. A prompt picks a domain and a random subset of its fields (so one domain yields many
schemas), draws values and renders one of four kinds of request:

* ``extract`` (~45%): a 1-3 sentence text stating the values, with an instruction before or after;
* ``create`` (~35%): "Create / Invent / Describe ..." with optional counts ("with 2 guests", and
  ``minItems`` = ``maxItems`` to match) and optional fixed values;
* ``classify`` (~10%): a short text and an enum label (sentiment, priority, severity, ...);
* ``call`` (~10%): function-call argument filling ("Call the book_hotel_room function ...").

    prompts = task_prompts(2000, seed=0)
    # [{"id": "task-extract-hotel_booking-0", "prompt": ..., "schema": {...}, "truth": {...}}]

``truth`` is the object the text states (extraction, classification, function call; it
validates against the schema) and ``None`` for creation prompts. Every schema is a closed object
(``additionalProperties: false``) that the library's default backend accepts.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from constrained_spec.errors import ConfigError

__all__ = ["DOMAINS", "KINDS", "task_prompts"]

#: The kinds of request, and the share of each in :func:`task_prompts` (the last takes the rest).
KINDS: tuple[tuple[str, float], ...] = (
    ("extract", 0.45), ("create", 0.35), ("classify", 0.10), ("call", 0.10))
# a prompt whose text was already produced is drawn again, at most this many times
_MAX_TRIES = 200

Gen = Callable[[random.Random], Any]


# --------------------------------------------------------------------------------------------
# value pools and generators

_FIRST = ("Amara", "Bjorn", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Idris", "Jonas",
          "Keiko", "Luca", "Mei", "Nadia", "Oskar", "Rafael", "Sofia", "Tomasz", "Uma", "Viktor",
          "Wen", "Yusuf", "Zara", "Ingrid", "Mateo", "Leila", "Kofi", "Elena", "Arjun", "Noor")
_LAST = ("Okafor", "Lindqvist", "Tanaka", "Moreau", "Haddad", "Kowalski", "Novak", "Fischer",
         "Costa", "Ibrahim", "Jensen", "Murphy", "Santos", "Varga", "Nakamura", "Petrov", "Rossi",
         "Dubois", "Kaur", "Mensah", "Ortiz", "Schmidt", "Yilmaz", "Berg", "Castillo")
_CITIES = ("Porto", "Krakow", "Osaka", "Nairobi", "Valencia", "Gothenburg", "Montreal", "Tbilisi",
           "Auckland", "Ljubljana", "Cape Town", "Hanoi", "Edinburgh", "Lyon", "Bogota", "Adelaide",
           "Seville", "Riga", "Chennai", "Denver", "Bergen", "Marrakesh", "Quebec City", "Graz",
           "Busan")
_COMPANIES = ("Bluefin Logistics", "Harbor & Pine", "Quillmark Studios", "Norvale Energy",
              "Tessellate Labs", "Ironbark Foods", "Lumen Cycle", "Cobalt Ridge", "Pebble Finance",
              "Orchid Health", "Vantage Rail", "Silverleaf Media", "Kestrel Systems",
              "Brightwater Supply", "Meridian Tools", "Fjord Analytics", "Granite Peak Insurance")
_MAIL_DOMAINS = ("mailbox.test", "example.org", "corp.example", "inbox.example.net")
_STREETS = ("Linden Street", "Harbour Road", "Maple Avenue", "Quarry Lane", "Station Square",
            "Orchard Way", "Riverside Drive", "Chapel Row")
_COLOURS = ("silver", "dark blue", "white", "black", "red", "graphite grey", "forest green")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _doctor(rng: random.Random) -> str:
    return f"Dr. {_person(rng)}"


def _email(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST).lower()}.{rng.choice(_LAST).lower()}@{rng.choice(_MAIL_DOMAINS)}"


def _phone(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"+1 {rng.randint(201, 989)} 555 {rng.randint(1000, 9999)}"
    return f"+44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2023, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice((0, 10, 15, 30, 45, 50)):02d}"


def _code(prefix: str, digits: int) -> Gen:
    return lambda rng: f"{prefix}-{rng.randint(10 ** (digits - 1), 10 ** digits - 1)}"


def _street(rng: random.Random) -> str:
    return f"{rng.randint(1, 240)} {rng.choice(_STREETS)}"


def _plate(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
    return (f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(100, 999)}-"
            f"{rng.choice(letters)}{rng.choice(letters)}")


def _and(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


# --------------------------------------------------------------------------------------------
# fields and domains

@dataclass(frozen=True)
class _Field:
    """One property of a domain: its schema, a value generator and phrases stating a value.

    ``phrases`` are templates with ``{v}`` (the rendered value) that read as a clause
    ("the guest is {v}"); for booleans they are the (true, false) clauses. ``extras`` are
    keywords added to the schema now and then (bounds, format, item counts)."""

    name: str
    schema: dict[str, Any]
    gen: Gen
    phrases: tuple[str, ...]
    label: str
    extras: dict[str, Any] = field(default_factory=dict)
    render: Callable[[Any], str] = str
    one: str = ""  # arrays: the singular of the item noun (``label`` is the plural)

    @property
    def type(self) -> str:
        return "enum" if "enum" in self.schema else self.schema["type"]


def _pool(gen: Gen | Sequence[Any]) -> Gen:
    if callable(gen):
        return gen
    values = tuple(gen)
    return lambda rng: rng.choice(values)


def _s(name: str, gen: Gen | Sequence[str], *phrases: str, label: str | None = None,
       fmt: str | None = None) -> _Field:
    return _Field(name, {"type": "string"}, _pool(gen), phrases, label or name.replace("_", " "),
                  {"format": fmt} if fmt else {})


def _i(name: str, lo: int, hi: int, *phrases: str, label: str | None = None) -> _Field:
    return _Field(name, {"type": "integer"}, lambda rng: rng.randint(lo, hi), phrases,
                  label or name.replace("_", " "), {"minimum": lo, "maximum": hi})


def _n(name: str, lo: float, hi: float, *phrases: str, nd: int = 2,
       label: str | None = None) -> _Field:
    return _Field(name, {"type": "number"}, lambda rng: round(rng.uniform(lo, hi), nd), phrases,
                  label or name.replace("_", " "), {"minimum": lo, "maximum": hi},
                  render=lambda v: f"{v:.{nd}f}")


def _b(name: str, yes: str, no: str, label: str | None = None) -> _Field:
    return _Field(name, {"type": "boolean"}, lambda rng: rng.random() < 0.5, (yes, no),
                  label or name.replace("_", " "))


def _e(name: str, choices: Sequence[str], *phrases: str, label: str | None = None) -> _Field:
    return _Field(name, {"type": "string", "enum": list(choices)}, _pool(choices), phrases,
                  label or name.replace("_", " "))


def _distinct(gen: Gen, rng: random.Random, k: int, key: Callable[[Any], Any] = lambda x: x
              ) -> list[Any]:
    out: list[Any] = []
    seen: list[Any] = []
    for _ in range(20 * k):
        if len(out) == k:
            break
        value = gen(rng)
        if key(value) not in seen:
            seen.append(key(value))
            out.append(value)
    return out


def _l(name: str, pool: Gen | Sequence[Any], *phrases: str, one: str, label: str | None = None,
       hi: int = 4, item: str = "string") -> _Field:
    """An array of strings (or integers) drawn without repeats from ``pool``."""
    gen = _pool(pool)
    return _Field(name, {"type": "array", "items": {"type": item}},
                  lambda rng: _distinct(gen, rng, rng.randint(1, hi)), phrases,
                  label or name.replace("_", " "), {"minItems": 1, "maxItems": hi}, render=_and,
                  one=one)


def _object_schema(subs: Sequence[_Field]) -> dict[str, Any]:
    return {"type": "object", "properties": {s.name: copy.deepcopy(s.schema) for s in subs},
            "required": [s.name for s in subs], "additionalProperties": False}


def _fill(subs: Sequence[_Field], template: str, value: dict[str, Any]) -> str:
    return template.format(**{s.name: s.render(value[s.name]) for s in subs})


def _objs(name: str, subs: Sequence[_Field], item: str, *phrases: str, one: str,
          label: str | None = None, hi: int = 3) -> _Field:
    """An array of small objects; ``item`` renders one of them from its sub-field values."""
    def gen(rng: random.Random) -> list[dict[str, Any]]:
        return _distinct(lambda r: {s.name: s.gen(r) for s in subs}, rng, rng.randint(1, hi),
                         key=lambda x: x[subs[0].name])

    return _Field(name, {"type": "array", "items": _object_schema(subs)}, gen, phrases,
                  label or name.replace("_", " "), {"minItems": 1, "maxItems": hi},
                  render=lambda v: _and([_fill(subs, item, x) for x in v]), one=one)


def _nest(name: str, subs: Sequence[_Field], template: str, *phrases: str,
          label: str | None = None) -> _Field:
    """A nested object, stated as one clause (``template`` names the sub-fields)."""
    return _Field(name, _object_schema(subs), lambda rng: {s.name: s.gen(rng) for s in subs},
                  phrases, label or name.replace("_", " "),
                  render=lambda v: _fill(subs, template, v))


@dataclass(frozen=True)
class _Classify:
    """An enum label a short text can be classified by: ``labels`` maps each label to sentences
    that clearly call for it; ``context`` names domain fields that may be stated alongside."""

    name: str
    what: str
    item: str
    labels: dict[str, tuple[str, ...]]
    context: tuple[str, ...]


@dataclass(frozen=True)
class _Domain:
    slug: str
    noun: str
    tool: str
    fields: tuple[_Field, ...]
    classify: _Classify | None = None
    joint: Gen | None = None  # values that must agree with each other, overriding the fields'


def _compound(rng: random.Random) -> dict[str, Any]:
    name, formula, mass = rng.choice((
        ("caffeine", "C8H10N4O2", 194.19), ("ethanol", "C2H6O", 46.07),
        ("acetone", "C3H6O", 58.08), ("glucose", "C6H12O6", 180.16),
        ("sodium chloride", "NaCl", 58.44), ("acetic acid", "C2H4O2", 60.05),
        ("ammonia", "NH3", 17.03), ("citric acid", "C6H8O7", 192.12)))
    return {"compound_name": name, "formula": formula, "molar_mass": mass}


_DOMAINS: tuple[_Domain, ...] = (
    _Domain("hotel_booking", "hotel booking", "book_hotel_room", (
        _s("guest_name", _person, "the guest is {v}", "the room is booked by {v}"),
        _s("hotel_name", ("Hotel Miramar", "The Linden Inn", "Casa Azul Suites", "Nordlys Lodge",
                          "Grand Palais Hotel", "Seabreeze Resort"), "the hotel is {v}",
           "the stay is at {v}"),
        _s("city", _CITIES, "the hotel is in {v}"),
        _s("check_in", _date, "check-in is on {v}", "the guest arrives on {v}",
           label="check-in date", fmt="date"),
        _i("nights", 1, 14, "the stay lasts {v} nights", label="number of nights"),
        _i("guests", 1, 6, "the party has {v} guests", label="number of guests"),
        _e("room_type", ("single", "double", "twin", "suite"), "they want a {v} room"),
        _b("breakfast_included", "breakfast is included", "breakfast is not included"),
        _n("price_per_night", 60, 450, "the rate is {v} per night"),
        _l("special_requests", ("late check-out", "extra pillows", "a quiet room", "a baby cot",
                                "an airport transfer", "a sea view"), "they asked for {v}",
           one="special request"),
    )),
    _Domain("car_listing", "car listing", "create_car_listing", (
        _s("model", ("Toyota Corolla", "Volkswagen Golf", "Kia Ceed", "Skoda Octavia",
                     "Mazda CX-5", "Volvo V60", "Renault Clio", "Hyundai Tucson"),
           "the car is a {v}", "it is a {v}"),
        _i("year", 2008, 2025, "it was built in {v}", label="model year"),
        _i("mileage_km", 5000, 220000, "it has {v} km on the clock", label="mileage"),
        _i("price_eur", 3000, 45000, "the asking price is {v} EUR", label="price"),
        _e("fuel", ("petrol", "diesel", "hybrid", "electric"), "the fuel type is {v}"),
        _e("transmission", ("manual", "automatic"), "it has a {v} gearbox"),
        _s("color", _COLOURS, "the colour is {v}", "the paint is {v}"),
        _s("seller_phone", _phone, "the seller can be reached on {v}"),
        _l("features", ("heated seats", "parking sensors", "cruise control", "a sunroof",
                        "a tow bar", "built-in navigation"), "it comes with {v}", one="feature"),
    )),
    _Domain("student_record", "student record", "add_student_record", (
        _s("student_name", _person, "the student is {v}"),
        _s("student_id", _code("STU", 5), "the student number is {v}"),
        _i("year_of_study", 1, 5, "they are in year {v}"),
        _n("gpa", 1.0, 4.0, "the GPA is {v}", label="GPA"),
        _s("program", ("Biology", "Mechanical Engineering", "History", "Computer Science",
                       "Economics", "Music"), "the program is {v}", "they study {v}"),
        _b("enrolled", "the student is currently enrolled", "the student is no longer enrolled"),
        _s("email", _email, "their email is {v}", fmt="email"),
        _l("courses", ("Linear Algebra", "World History", "Organic Chemistry", "Spanish II",
                       "Art Theory", "Physics I", "Modern Poetry"), "the courses are {v}",
           one="course"),
        _nest("advisor", (_s("name", _person), _s("office", _code("Room", 3))),
              "{name} in {office}", "the advisor is {v}"),
    )),
    _Domain("bank_transaction", "bank transaction", "log_transaction", (
        _s("transaction_id", _code("TXN", 6), "the transaction ID is {v}"),
        _s("date", _date, "it was made on {v}", fmt="date"),
        _n("amount", 2, 2500, "the amount is {v}"),
        _e("currency", ("USD", "EUR", "GBP", "JPY", "CHF"), "the currency is {v}"),
        _s("merchant", ("FreshMart", "City Power", "SkyWay Airlines", "Bean There Cafe",
                        "Metro Transit", "Pixel Games"), "the merchant is {v}"),
        _e("direction", ("debit", "credit"), "it is a {v}"),
        _s("card_last4", lambda rng: f"{rng.randint(0, 9999):04d}", "the card ends in {v}",
           label="last four card digits"),
        _b("pending", "it is still pending", "it has already cleared"),
    ), _Classify("category", "spending category", "transaction", {
        "groceries": ("Bought milk, bread and vegetables for the week.",
                      "This was the weekly supermarket shop."),
        "travel": ("It paid for a return flight and a rental car.",
                   "Train tickets for a weekend trip to the coast."),
        "utilities": ("This is the monthly electricity bill.",
                      "Water and gas charges for the last quarter."),
        "dining": ("Dinner for two at a small bistro.", "Lunch and coffee with a colleague."),
        "entertainment": ("Two tickets for a concert in the park.",
                          "A yearly subscription to a film streaming service."),
    }, ("transaction_id", "date", "amount"))),
    _Domain("support_ticket", "support ticket", "open_support_ticket", (
        _s("ticket_id", _code("SUP", 5), "the ticket number is {v}"),
        _s("customer_name", _person, "the customer is {v}"),
        _s("customer_email", _email, "their email is {v}", fmt="email"),
        _s("product", ("SmartHub Mini", "CloudVault app", "PrintJet 300", "FitBand 2",
                       "RouteMaster router"), "it concerns the {v}"),
        _e("channel", ("email", "phone", "chat", "portal"), "it came in by {v}"),
        _s("opened_on", _date, "it was opened on {v}", fmt="date"),
        _l("tags", ("billing", "login", "hardware", "refund", "shipping", "setup"),
           "it is tagged {v}", one="tag"),
        _b("escalated", "it has been escalated", "it has not been escalated"),
    ), _Classify("priority", "priority", "support ticket", {
        "low": ("The customer asks whether the manual exists in Portuguese.",
                "They wonder if a dark theme is planned for next year."),
        "medium": ("Sync is slow in the afternoons but still finishes.",
                   "One report exports with the wrong date format."),
        "high": ("The customer cannot sign in since this morning and has a demo tomorrow.",
                 "All invoices for the month failed to send."),
        "urgent": ("The whole shop is down and no customer can pay right now.",
                   "Private records are visible to the wrong users at this moment."),
    }, ("ticket_id", "customer_name", "product"))),
    _Domain("sports_match", "sports match result", "record_match_result", (
        _s("home_team", ("Riverside Rovers", "Northgate United", "Harbour City FC",
                         "Valley Wolves"), "the home side was {v}"),
        _s("away_team", ("Eastfield Athletic", "Ironworks SC", "Lakeside Comets",
                         "Old Mill Rangers"), "the visitors were {v}"),
        _i("home_score", 0, 6, "the home side scored {v}"),
        _i("away_score", 0, 6, "the visitors scored {v}"),
        _s("match_date", _date, "the match was played on {v}", fmt="date"),
        _s("venue", ("Kingsmead Park", "Old Quarry Ground", "Lakeside Arena", "Millbrook Stadium"),
           "the venue was {v}"),
        _i("attendance", 800, 60000, "the crowd numbered {v}"),
        _b("extra_time", "it went to extra time", "it finished in normal time"),
        _l("scorers", _person, "the scorers were {v}", one="scorer"),
        _e("competition", ("league", "cup", "friendly"), "it was a {v} game"),
    )),
    _Domain("restaurant_review", "restaurant review", "submit_restaurant_review", (
        _s("restaurant", ("Casa Verde", "The Copper Pot", "Sakura Tei", "Little Lisbon",
                          "Olive & Thyme", "Blue Lantern"), "the restaurant is {v}",
           "we ate at {v}"),
        _s("reviewer", _person, "the reviewer is {v}"),
        _i("rating", 1, 5, "the rating is {v} out of 5"),
        _e("cuisine", ("italian", "japanese", "portuguese", "indian", "mexican", "french"),
           "the cuisine is {v}"),
        _s("visit_date", _date, "the visit was on {v}", fmt="date"),
        _e("price_level", ("budget", "moderate", "expensive"), "prices are {v}"),
        _l("dishes", ("mushroom risotto", "grilled octopus", "miso ramen", "lamb curry",
                      "fish tacos", "lemon tart"), "they tried {v}", one="dish"),
        _b("would_return", "the reviewer would go back", "the reviewer would not go back"),
    ), _Classify("sentiment", "sentiment", "restaurant review", {
        "positive": ("Every dish arrived hot and the staff remembered our names.",
                     "Best lemon tart in years, and the service was warm and quick."),
        "negative": ("We waited fifty minutes and the soup came out cold.",
                     "The waiter was rude and the bill listed dishes we never ordered."),
        "mixed": ("The food was excellent but the room was too loud to talk.",
                  "Lovely terrace, though the pasta was bland and overpriced."),
    }, ("restaurant", "visit_date", "reviewer"))),
    _Domain("device_spec", "device spec sheet", "register_device", (
        _s("device_name", ("Aurora X2 laptop", "Nimbus 11 tablet", "Pulse S phone",
                           "Vertex Pro monitor", "Strata Go speaker"), "the device is the {v}"),
        _s("manufacturer", _COMPANIES, "it is made by {v}"),
        _i("ram_gb", 2, 64, "it has {v} GB of RAM", label="RAM"),
        _i("storage_gb", 32, 2048, "storage is {v} GB", label="storage"),
        _n("screen_inches", 5, 32, "the screen measures {v} inches", nd=1, label="screen size"),
        _i("weight_grams", 150, 2500, "it weighs {v} grams", label="weight"),
        _e("os", ("android", "windows", "linux", "chromeos"), "it runs {v}",
           label="operating system"),
        _l("ports", ("USB-C", "HDMI", "a headphone jack", "an SD card slot", "Ethernet",
                     "Thunderbolt"), "the ports are {v}", one="port"),
        _b("has_5g", "it supports 5G", "it has no 5G", label="5G support"),
        _nest("dimensions_mm", (_i("width", 60, 700), _i("height", 120, 450),
                                _i("depth", 5, 40)),
              "{width} x {height} x {depth} mm", "it measures {v}", label="dimensions"),
    )),
    _Domain("shipment_tracking", "shipment tracking update", "update_shipment", (
        _s("tracking_number", _code("TRK", 8), "the tracking number is {v}"),
        _s("carrier", ("SwiftPost", "Continental Freight", "BlueBox Express", "Aeroparcel"),
           "it is carried by {v}"),
        _s("origin", _CITIES, "it was sent from {v}", label="origin city"),
        _s("destination", _CITIES, "it is going to {v}", label="destination city"),
        _e("status", ("in transit", "delivered", "held at customs", "out for delivery"),
           "its status is {v}"),
        _s("estimated_delivery", _date, "delivery is expected on {v}", fmt="date"),
        _n("weight_kg", 0.2, 40, "it weighs {v} kg", nd=1, label="weight"),
        _b("signature_required", "a signature is required", "no signature is needed"),
        _objs("scans", (_s("location", _CITIES), _s("date", _date)), "{location} on {date}",
              "it was scanned in {v}", one="scan"),
    )),
    _Domain("conference_talk", "conference talk", "schedule_talk", (
        _s("title", ("Scaling Search at Small Companies", "What Bees Teach Us About Routing",
                     "Type Hints in Practice", "Carbon-Aware Computing",
                     "Lessons from a Failed Migration", "Designing for Slow Networks"),
           "the talk is called {v}"),
        _s("speaker", _person, "the speaker is {v}", "it is given by {v}"),
        _e("track", ("backend", "frontend", "data", "security", "design"),
           "it is in the {v} track"),
        _s("room", ("Hall A", "Room 204", "the Auditorium", "Workshop 3"),
           "it takes place in {v}"),
        _s("date", _date, "it is on {v}", fmt="date"),
        _s("start_time", _time, "it starts at {v}"),
        _i("duration_minutes", 15, 90, "it lasts {v} minutes", label="duration"),
        _b("recorded", "it will be recorded", "it will not be recorded"),
        _l("topics", ("python", "performance", "accessibility", "testing", "cloud costs",
                      "observability"), "it covers {v}", one="topic"),
    )),
    _Domain("pet_adoption", "pet adoption listing", "list_pet_for_adoption", (
        _s("pet_name", ("Biscuit", "Luna", "Pepper", "Mochi", "Rocco", "Juniper", "Tofu",
                        "Ziggy"), "the pet is called {v}", "its name is {v}"),
        _e("species", ("dog", "cat", "rabbit", "guinea pig"), "it is a {v}"),
        _i("age_years", 0, 15, "it is {v} years old", label="age"),
        _e("sex", ("male", "female"), "the animal is {v}"),
        _b("vaccinated", "it is fully vaccinated", "it is not vaccinated yet"),
        _l("good_with", ("children", "other dogs", "cats", "older people"),
           "it gets along with {v}", one="companion", label="companions it is good with"),
        _s("shelter", ("Paws & Whiskers Rescue", "Northside Animal Shelter",
                       "Second Chance Pets"), "it is at {v}"),
        _n("adoption_fee", 0, 300, "the adoption fee is {v}"),
        _s("contact_phone", _phone, "the shelter's phone is {v}"),
    )),
    _Domain("apartment_listing", "apartment listing", "post_apartment_listing", (
        _nest("address", (_s("street", _street), _s("city", _CITIES),
                          _s("postal_code", lambda rng: f"{rng.randint(10000, 99999)}")),
              "{street}, {postal_code} {city}", "it is at {v}", "the address is {v}"),
        _i("bedrooms", 0, 5, "it has {v} bedrooms"),
        _i("bathrooms", 1, 3, "there are {v} bathrooms"),
        _i("area_sqm", 25, 180, "the floor area is {v} square metres", label="floor area"),
        _i("monthly_rent", 400, 3500, "rent is {v} per month"),
        _b("furnished", "it comes furnished", "it is unfurnished"),
        _s("available_from", _date, "it is available from {v}", fmt="date"),
        _l("amenities", ("a balcony", "an elevator", "a dishwasher", "bike storage",
                         "a parking space", "a washing machine"), "amenities include {v}",
           one="amenity"),
        _b("pets_allowed", "pets are allowed", "no pets are allowed"),
        _s("landlord_email", _email, "the landlord's email is {v}", fmt="email"),
    )),
    _Domain("online_course", "online course", "publish_course", (
        _s("title", ("Intro to Data Visualization", "Sourdough Baking Basics",
                     "Spanish for Travelers", "Personal Finance 101", "Drawing Birds",
                     "Practical SQL"), "the course is called {v}"),
        _s("instructor", _person, "it is taught by {v}"),
        _e("level", ("beginner", "intermediate", "advanced"), "it is aimed at {v} learners"),
        _i("duration_hours", 1, 60, "it takes about {v} hours", label="length in hours"),
        _n("price", 0, 199, "it costs {v}"),
        _e("language", ("English", "Spanish", "French", "German"), "it is taught in {v}"),
        _objs("modules", (_s("title", ("Getting started", "Core ideas", "Hands-on project",
                                       "Review and quiz", "Going further")),
                          _i("minutes", 10, 90)),
              "{title} ({minutes} min)", "the modules are {v}", one="module"),
        _b("certificate", "a certificate is included", "there is no certificate"),
        _n("rating", 1, 5, "learners rate it {v}", nd=1),
    )),
    _Domain("album", "music album", "add_album", (
        _s("title", ("Paper Lanterns", "Midnight Ferry", "Low Tide Radio", "Glass Orchard",
                     "Northern Static", "Velvet Signal"), "the album is called {v}"),
        _s("artist", ("The Kite Collective", "Ines Varela", "Moss & Meridian", "DJ Halcyon",
                      "Sunday Lantern"), "it is by {v}"),
        _i("release_year", 1965, 2025, "it came out in {v}"),
        _e("genre", ("rock", "jazz", "electronic", "folk", "hip hop", "classical"),
           "the genre is {v}"),
        _s("record_label", ("Tidewater Records", "Greyhound Sound", "Pinecone Music"),
           "it was released on {v}"),
        _i("track_count", 6, 18, "it has {v} tracks", label="number of tracks"),
        _b("explicit", "it carries an explicit label", "it has no explicit content"),
        _objs("tracks", (_s("title", ("Harbor Lights", "Second Window", "Run the Static",
                                      "Slow Comet", "Cinnamon Rain", "Quiet Engine")),
                         _s("duration", lambda rng: f"{rng.randint(2, 6)}:{rng.randint(0, 59):02d}")),
              "{title} ({duration})", "the tracks include {v}", one="track"),
    )),
    _Domain("clinic_appointment", "clinic appointment", "book_appointment", (
        _s("patient_name", _person, "the patient is {v}"),
        _s("doctor", _doctor, "the appointment is with {v}"),
        _e("department", ("cardiology", "dermatology", "pediatrics", "orthopedics",
                          "general practice"), "the department is {v}"),
        _s("date", _date, "it is on {v}", fmt="date"),
        _s("time", _time, "it starts at {v}"),
        _s("reason", ("annual check-up", "persistent cough", "knee pain", "skin rash",
                      "blood test follow-up", "vaccination"), "the reason is {v}"),
        _b("first_visit", "it is their first visit", "they have been here before"),
        _s("insurance_number", _code("INS", 7), "the insurance number is {v}"),
        _s("phone", _phone, "the patient's phone is {v}"),
    )),
    _Domain("train_ticket", "train ticket", "buy_train_ticket", (
        _s("passenger", _person, "the passenger is {v}"),
        _s("from_station", _CITIES, "the train leaves from {v}", label="departure station"),
        _s("to_station", _CITIES, "the destination is {v}", label="arrival station"),
        _s("travel_date", _date, "travel is on {v}", fmt="date"),
        _s("departure_time", _time, "it departs at {v}"),
        _e("travel_class", ("first", "second"), "the seat is in {v} class", label="class"),
        _s("seat", lambda rng: f"C{rng.randint(1, 12)}-{rng.randint(1, 80)}",
           "the seat number is {v}"),
        _n("price", 9, 240, "the fare is {v}"),
        _b("railcard", "a railcard discount applies", "no railcard is used"),
        _l("stops", _CITIES, "it stops at {v}", one="stop"),
    )),
    _Domain("employee_profile", "employee profile", "create_employee", (
        _s("full_name", _person, "the employee is {v}"),
        _s("employee_id", _code("EMP", 4), "the employee ID is {v}"),
        _e("department", ("engineering", "finance", "marketing", "sales", "hr"),
           "they work in {v}"),
        _s("job_title", ("Data Analyst", "Account Manager", "Site Reliability Engineer",
                         "Payroll Specialist", "UX Researcher"), "their title is {v}"),
        _s("start_date", _date, "they started on {v}", fmt="date"),
        _i("salary", 30000, 180000, "the annual salary is {v}"),
        _b("remote", "they work remotely", "they work on site"),
        _l("skills", ("SQL", "negotiation", "Python", "public speaking", "Excel", "Figma"),
           "their skills are {v}", one="skill"),
        _s("manager", _person, "they report to {v}"),
        _s("work_email", _email, "the work email is {v}", fmt="email"),
    )),
    _Domain("weather_observation", "weather observation", "log_weather_observation", (
        _s("station", ("Harbor Point", "Airport North", "Hilltop Mast", "Old Lighthouse"),
           "the station is {v}"),
        _s("city", _CITIES, "it was taken near {v}"),
        _s("date", _date, "the reading is from {v}", fmt="date"),
        _s("time", _time, "it was recorded at {v}"),
        _n("temperature_c", -25, 42, "the temperature is {v} degrees Celsius", nd=1,
           label="temperature"),
        _i("humidity_pct", 5, 100, "humidity is {v} percent", label="humidity"),
        _i("wind_speed_kmh", 0, 120, "the wind blows at {v} km/h", label="wind speed"),
        _e("wind_direction", ("N", "NE", "E", "SE", "S", "SW", "W", "NW"),
           "the wind comes from {v}"),
        _n("precipitation_mm", 0, 80, "precipitation is {v} mm", nd=1),
        _b("storm_warning", "a storm warning is active", "there is no storm warning"),
    ), _Classify("conditions", "weather type", "weather report", {
        "sunny": ("Clear blue sky all afternoon, not a cloud in sight.",),
        "rainy": ("Steady drizzle since dawn and the streets are soaked.",
                  "Rain has not stopped for six hours."),
        "snowy": ("Thick flakes are falling and ten centimetres lie on the ground.",),
        "foggy": ("Visibility is under a hundred metres and the harbour is hidden in grey.",),
        "stormy": ("Thunder, lightning and gusts strong enough to bend the trees.",),
    }, ("station", "city", "date"))),
    _Domain("stock_quote", "stock quote", "record_stock_quote", (
        _s("ticker", ("NRVL", "TSLB", "KSTR", "BRWT", "MRDN", "QMRK"), "the ticker is {v}"),
        _s("company", _COMPANIES, "the company is {v}"),
        _e("exchange", ("NYSE", "NASDAQ", "LSE", "TSE", "XETRA"), "it trades on {v}"),
        _n("price", 1, 900, "the last price is {v}"),
        _n("change_pct", -12, 12, "the change is {v} percent", label="percent change"),
        _i("volume", 10000, 9000000, "volume was {v} shares"),
        _s("date", _date, "the quote is from {v}", fmt="date"),
        _b("market_open", "the market is open", "the market is closed"),
    )),
    _Domain("library_loan", "library loan", "register_loan", (
        _s("borrower", _person, "the borrower is {v}"),
        _s("card_number", _code("LIB", 6), "the library card number is {v}"),
        _s("book_title", ("The Salt Road", "A Field Guide to Clouds", "Winter in Kyoto",
                          "The Patient Gardener", "Numbers Without Fear",
                          "Letters from the Lighthouse"), "the book is {v}"),
        _s("author", _person, "it was written by {v}"),
        _s("loan_date", _date, "it was borrowed on {v}", fmt="date"),
        _s("due_date", _date, "it is due back on {v}", fmt="date"),
        _i("renewals", 0, 3, "it has been renewed {v} times", label="number of renewals"),
        _b("overdue", "it is overdue", "it is not overdue"),
        _e("format", ("hardcover", "paperback", "ebook", "audiobook"), "the copy is {v}"),
    )),
    _Domain("package_dimensions", "parcel measurement", "quote_parcel", (
        _s("package_id", _code("PKG", 5), "the parcel ID is {v}"),
        _nest("dimensions_cm", (_n("length", 5, 120, nd=1), _n("width", 5, 80, nd=1),
                                _n("height", 2, 60, nd=1)),
              "{length} by {width} by {height} cm", "it measures {v}", label="dimensions"),
        _n("weight_kg", 0.1, 30, "it weighs {v} kg", nd=2, label="weight"),
        _b("fragile", "it is fragile", "it is not fragile"),
        _l("contents", ("books", "ceramic mugs", "clothing", "spare parts", "board games"),
           "it contains {v}", one="content item", label="contents"),
        _e("shipping_speed", ("standard", "express", "overnight"), "it ships {v}"),
        _n("insured_value", 0, 2000, "it is insured for {v}"),
        _s("sender", _person, "the sender is {v}"),
    )),
    _Domain("gym_workout", "gym workout log", "log_workout", (
        _s("athlete", _person, "the athlete is {v}"),
        _s("date", _date, "the session was on {v}", fmt="date"),
        _i("duration_minutes", 10, 150, "it lasted {v} minutes", label="duration"),
        _s("location", ("Iron Temple Gym", "the home garage", "FlexZone Downtown",
                        "the park fitness rig"), "it took place at {v}"),
        _objs("exercises", (_s("name", ("squats", "push-ups", "deadlifts", "lunges", "pull-ups",
                                        "bench presses")),
                            _i("sets", 1, 6), _i("reps", 3, 20)),
              "{sets} sets of {reps} {name}", "the routine was {v}", one="exercise"),
        _i("calories", 100, 1200, "about {v} calories were burned"),
        _b("personal_best", "a personal best was set", "no personal best this time"),
    ), _Classify("intensity", "intensity", "workout", {
        "light": ("Just a gentle stretch and a slow walk on the treadmill.",),
        "moderate": ("Steady cycling, breathing harder but still able to chat.",),
        "intense": ("All-out sprints until I could barely stand.",
                    "Heavy lifting to failure on every set, completely drained afterwards."),
    }, ("athlete", "date", "location"))),
    _Domain("travel_itinerary", "travel itinerary", "save_itinerary", (
        _s("traveler", _person, "the traveler is {v}"),
        _s("destination", _CITIES, "the trip goes to {v}"),
        _s("start_date", _date, "it starts on {v}", fmt="date"),
        _s("end_date", _date, "it ends on {v}", fmt="date"),
        _i("budget", 300, 8000, "the budget is {v}"),
        _e("travel_mode", ("flight", "train", "car", "ferry"), "they travel by {v}"),
        _l("activities", ("a walking tour", "a cooking class", "museum visits", "a boat trip",
                          "wine tasting", "hiking"), "planned activities are {v}",
           one="activity"),
        _objs("days", (_i("day", 1, 9), _s("city", _CITIES)), "day {day} in {city}",
              "the plan is {v}", one="day"),
        _b("hotel_booked", "the hotel is already booked", "no hotel is booked yet"),
    )),
    _Domain("bug_ticket", "bug ticket", "file_bug", (
        _s("bug_id", _code("BUG", 4), "the bug ID is {v}"),
        _s("title", ("Export button does nothing", "Search returns duplicates",
                     "Upload fails for large photos", "Reminders use the wrong timezone",
                     "Password reset email never arrives"), "the summary is {v}"),
        _e("component", ("frontend", "backend", "mobile", "api", "database"),
           "the component is {v}"),
        _s("reporter", _person, "it was reported by {v}"),
        _s("app_version", lambda rng: f"{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
           "it shows up in version {v}"),
        _l("steps", ("open the settings page", "tap Export", "choose PDF",
                     "sign out and back in", "switch to the compact view",
                     "attach a 20 MB file"), "the steps are {v}", one="step",
           label="steps to reproduce"),
        _b("reproducible", "it happens every time", "it happens only sometimes"),
        _e("platform", ("web", "android", "ios", "windows", "macos"), "the platform is {v}"),
    ), _Classify("severity", "severity", "bug report", {
        "minor": ("A label on the settings page is a few pixels off.",
                  "The tooltip on the save button has a typo."),
        "major": ("Saving a draft silently drops its attachments.",
                  "Filters reset every time the list reloads."),
        "critical": ("Every user loses their data when sync runs.",
                     "Checkout fails for every customer, so no orders go through."),
    }, ("bug_id", "reporter", "app_version"))),
    _Domain("server_config", "server configuration", "provision_server", (
        _s("hostname", lambda rng: f"{rng.choice(('web', 'db', 'cache', 'worker', 'api'))}-"
                                   f"{rng.randint(1, 40):02d}", "the hostname is {v}"),
        _e("region", ("eu-west", "us-east", "ap-south", "sa-east"), "it runs in {v}"),
        _i("cpu_cores", 1, 64, "it has {v} CPU cores"),
        _i("memory_gb", 1, 512, "memory is {v} GB", label="memory"),
        _i("disk_gb", 20, 4000, "the disk is {v} GB", label="disk size"),
        _e("os", ("ubuntu-22.04", "debian-12", "rocky-9"), "the image is {v}",
           label="operating system"),
        _l("open_ports", (22, 80, 443, 5432, 6379, 8080), "ports {v} are open",
           one="open port", item="integer"),
        _b("public_ip", "it has a public IP", "it has no public IP"),
        _e("backups", ("daily", "weekly", "monthly"), "backups run {v}",
           label="backup schedule"),
    )),
    _Domain("chemical_compound", "chemical sample record", "add_compound", (
        _s("compound_name", lambda rng: _compound(rng)["compound_name"], "the compound is {v}"),
        _s("formula", lambda rng: _compound(rng)["formula"], "its formula is {v}"),
        _n("molar_mass", 1, 500, "the molar mass is {v} g/mol"),
        _s("sample_id", _code("CS", 5), "the sample ID is {v}"),
        _n("purity_pct", 90, 99.99, "purity is {v} percent", label="purity"),
        _n("quantity_g", 1, 1000, "there are {v} grams", nd=1, label="quantity in grams"),
        _s("supplier", _COMPANIES, "it was supplied by {v}"),
        _l("hazards", ("flammable", "toxic", "corrosive", "irritant", "oxidizer"),
           "it is labelled {v}", one="hazard"),
        _b("refrigerated", "it must be kept cold", "it is stored at room temperature"),
    ), joint=_compound),
    _Domain("museum_exhibit", "museum exhibit", "catalog_exhibit", (
        _s("title", ("Bronze Age Tools of the Danube", "Portraits in Blue", "Clockwork Wonders",
                     "Textiles of the Silk Road", "Early Photography"), "the exhibit is {v}"),
        _s("curator", _person, "it is curated by {v}"),
        _s("gallery", lambda rng: f"Gallery {rng.randint(1, 12)}", "it is shown in {v}"),
        _s("opens", _date, "it opens on {v}", fmt="date", label="opening date"),
        _s("closes", _date, "it closes on {v}", fmt="date", label="closing date"),
        _n("ticket_price", 0, 35, "a ticket costs {v}"),
        _e("period", ("ancient", "medieval", "renaissance", "modern", "contemporary"),
           "it covers the {v} period"),
        _l("highlights", ("a gilded astrolabe", "a porcelain vase", "a silk kimono",
                          "a pocket watch", "a daguerreotype"), "highlights include {v}",
           one="highlight"),
        _b("audio_guide", "an audio guide is available", "there is no audio guide"),
    )),
    _Domain("podcast_episode", "podcast episode", "publish_episode", (
        _s("show", ("Signal & Noise", "The Long Table", "Small Data", "Field Notes Radio"),
           "the show is {v}"),
        _i("episode_number", 1, 400, "it is episode {v}"),
        _s("title", ("The Quiet Economy", "Building in Public", "Maps and Myths",
                     "Slow Mornings"), "the episode is called {v}"),
        _s("host", _person, "the host is {v}"),
        _l("guests", _person, "the guests are {v}", one="guest", hi=3),
        _i("duration_minutes", 15, 120, "it runs {v} minutes", label="duration"),
        _s("release_date", _date, "it was released on {v}", fmt="date"),
        _b("explicit", "it is marked explicit", "it is not marked explicit"),
    ), _Classify("topic", "topic", "podcast episode", {
        "technology": ("We compare three open-source databases and explain indexing.",),
        "sports": ("A breakdown of the marathon season and what makes a good pacer.",),
        "health": ("Why sleep matters for memory, with tips for shift workers.",),
        "finance": ("How index funds work and how to think about their fees.",),
        "history": ("The story of the printing press and the people who fought it.",),
    }, ("show", "episode_number", "host"))),
    _Domain("sales_lead", "sales lead", "create_lead", (
        _s("contact_name", _person, "the contact is {v}"),
        _s("company", _COMPANIES, "they work at {v}"),
        _s("email", _email, "their email is {v}", fmt="email"),
        _s("phone", _phone, "their phone is {v}"),
        _e("source", ("website", "referral", "trade show", "cold call"), "the lead came from {v}",
           "the source was {v}"),
        _i("estimated_value", 1000, 250000, "the deal could be worth {v}"),
        _l("interested_in", ("the analytics add-on", "premium support", "API access",
                             "team licenses", "an onboarding package"),
           "they are interested in {v}", one="product"),
        _s("follow_up_date", _date, "the follow-up is on {v}", fmt="date"),
    ), _Classify("lead_temperature", "lead temperature", "sales lead", {
        "hot": ("They asked for a contract this week and budget is approved.",),
        "warm": ("They liked the demo and want to talk again next quarter.",),
        "cold": ("They downloaded a brochure but ignored two follow-up emails.",),
    }, ("contact_name", "company", "source"))),
    _Domain("warranty_claim", "warranty claim", "submit_warranty_claim", (
        _s("claim_id", _code("WC", 5), "the claim number is {v}"),
        _s("customer", _person, "the customer is {v}"),
        _s("product", ("BrewMaster coffee machine", "Glide e-scooter", "Arcus washing machine",
                       "Tundra fridge", "Halo headphones"), "the product is a {v}"),
        _s("purchase_date", _date, "it was bought on {v}", fmt="date"),
        _s("serial_number", lambda rng: f"SN{rng.randint(10000000, 99999999)}",
           "the serial number is {v}"),
        _s("issue", ("the display flickers", "it no longer charges", "the door seal leaks",
                     "it rattles at high speed"), "the problem is that {v}"),
        _b("under_warranty", "it is still under warranty", "the warranty has expired"),
        _e("requested_remedy", ("repair", "replacement", "refund"), "the customer wants a {v}"),
    ), _Classify("claim_type", "claim type", "warranty claim", {
        "manufacturing defect": ("It stopped working after a week of normal use, never dropped.",),
        "accidental damage": ("It fell off the counter and the casing cracked.",),
        "normal wear": ("After four years of daily use the buttons are worn smooth.",),
    }, ("claim_id", "product", "customer"))),
    _Domain("parking_fine", "parking fine", "issue_parking_fine", (
        _s("fine_number", _code("PF", 6), "the fine number is {v}"),
        _s("license_plate", _plate, "the plate is {v}"),
        _e("violation", ("expired meter", "no permit", "double parking", "blocked driveway",
                         "loading zone"), "the violation is {v}"),
        _s("street", _street, "the car was parked at {v}"),
        _s("city", _CITIES, "it happened in {v}"),
        _s("issued_on", _date, "it was issued on {v}", fmt="date"),
        _s("time", _time, "it was written at {v}"),
        _i("amount", 20, 250, "the fine is {v}"),
        _b("paid", "it has been paid", "it has not been paid"),
        _i("officer_badge", 1000, 9999, "the officer's badge is {v}", label="badge number"),
    )),
    _Domain("maintenance_request", "maintenance request", "create_work_order", (
        _s("request_id", _code("MR", 4), "the request number is {v}"),
        _s("tenant", _person, "the tenant is {v}"),
        _s("unit", lambda rng: f"Unit {rng.randint(1, 40)}{rng.choice('ABCD')}",
           "they live in {v}"),
        _s("issue", ("a leaking kitchen tap", "a broken heater", "a stuck window",
                     "a flickering hallway light", "a blocked drain"), "the problem is {v}"),
        _s("reported_on", _date, "it was reported on {v}", fmt="date"),
        _e("preferred_time", ("morning", "afternoon", "evening"), "a visit in the {v} suits"),
        _b("entry_allowed", "the technician may enter when nobody is home",
           "someone must be home for the visit", label="entry permission"),
        _i("photos_attached", 0, 5, "there are {v} photos attached",
           label="number of photos"),
    ), _Classify("urgency", "urgency", "maintenance request", {
        "low": ("A cupboard door squeaks when it opens.",),
        "normal": ("The bathroom fan has stopped working.",),
        "emergency": ("Water is pouring through the ceiling into the living room.",
                      "There is a strong smell of gas in the kitchen."),
    }, ("request_id", "tenant", "unit"))),
)

#: The domains prompts are drawn from (their slugs, as used in the ids).
DOMAINS: tuple[str, ...] = tuple(d.slug for d in _DOMAINS)


# --------------------------------------------------------------------------------------------
# instruction templates

_EXTRACT = (
    "Extract the {noun} details: {text}",
    "Extract {a_noun} from this message: \"{text}\"",
    "Parse this {noun} into JSON: {text}",
    "Parse the following text as {a_noun}.\n\n{text}",
    "Turn this into {a_noun} record: {text}",
    "{Noun} note: '{text}'",
    "{Noun} details from a colleague: {text}",
    "From the text below, fill in the {noun} fields.\n\n{text}",
    "{text}\n\nExtract the {noun} from the text above.",
    "Read this and return the {noun} as JSON: {text}",
    "Pull the {noun} data out of this: \"{text}\"",
    "Convert the following {noun} description to structured data. {text}",
    "Capture this {noun} in the schema: {text}",
    "Here is {a_noun} I received by email: '{text}' Record it.",
    "Please structure this {noun} information: {text}",
    "Given the text '{text}', produce the matching {noun} object.",
    "{text}\nPut that {noun} into JSON.",
    "Fill in the {noun} form from these notes: {text}",
    "My notes say: {text} Make {a_noun} out of them.",
)
_CREATE_VERBS = ("Create", "Invent", "Write", "Describe", "Make up", "Generate", "Come up with",
                 "Draft", "Produce", "Give me", "Sketch", "Imagine")
_CREATE_WRAPS = (
    "{verb} {thing}.", "{verb} {thing}.", "{verb} {thing}.",
    "I need {thing} for a demo.",
    "For testing, make {thing}.",
    "Can you write {thing}?",
    "Please invent {thing}.",
    "We need sample data: {thing}.",
)
_CREATE_FIELDS = ("Include {labels}.", "It should have {labels}.", "Fill in {labels}.",
                  "Fields: {names}.", "Give {labels}.")
_ADJECTIVES = ("", "", "realistic", "fictional", "sample", "plausible", "made-up", "example",
               "test", "typical", "believable", "new")
_CLASSIFY = (
    "Label the {what} of this {item}: \"{text}\"",
    "Decide the {what} for the {item} below.\n{text}",
    "{Item}: '{text}' What {what} does it have?",
    "Assign {a_what} to this {item}. {text}",
    "Read the {item} and pick its {what}: {text}",
    "{text}\nWhich {what} fits this {item}?",
    "Categorize by {what}: '{text}'",
    "Tag this {item} with {a_what}: {text}",
    "Classify this {item} by {what}. {text}",
    "What {what} would you give this {item}? \"{text}\"",
)
_CALL = (
    "Call the {tool} function for this: {clauses}.",
    "Call {tool} with the following: {clauses}.",
    "Use the {tool} tool. {sentences}",
    "Invoke {tool} for {a_noun} where {clauses}.",
    "Fill in the arguments for {tool}() given that {clauses}.",
    "Prepare a {tool} call: {sentences}",
    "I want to run {tool}; {clauses}. What are the arguments?",
    "{sentences} Call {tool} with these details.",
    "Make a function call to {tool}: {clauses}.",
    "Arguments for {tool}, please. {sentences}",
)


# --------------------------------------------------------------------------------------------
# assembly

def _cap(template: str) -> str:
    # capitalise the template, never a value: "{v} ..." stays as it is
    return template if template.startswith("{") else template[:1].upper() + template[1:]


def _clause(f: _Field, value: Any, rng: random.Random, cap: bool = False) -> str:
    if f.type == "boolean":
        template = f.phrases[0] if value else f.phrases[1]
    else:
        template = rng.choice(f.phrases)
    return (_cap(template) if cap else template).format(v=f.render(value))


def _joined(clauses: list[str]) -> str:
    return clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + " and " + clauses[-1]


def _sentences(fields: Sequence[_Field], values: dict[str, Any], rng: random.Random) -> str:
    """1-3 sentences stating every value, in shuffled (or the schema's) order."""
    order = list(fields)
    if rng.random() < 0.7:
        rng.shuffle(order)
    n_sent = rng.randint(1, min(3, len(order)))
    cuts = sorted(rng.sample(range(1, len(order)), n_sent - 1))
    out = []
    for lo, hi in zip([0, *cuts], [*cuts, len(order)]):
        group = order[lo:hi]
        clauses = [_clause(f, values[f.name], rng, cap=j == 0) for j, f in enumerate(group)]
        out.append(_joined(clauses) + ".")
    return " ".join(out)


def _pick_fields(domain: _Domain, rng: random.Random) -> list[_Field]:
    """The first field and a random subset of the others (3-9 in all), in the domain's order."""
    rest = list(domain.fields[1:])
    k = min(len(domain.fields), rng.choice((3, 4, 4, 5, 5, 5, 6, 6, 7, 8, 9)))
    chosen = sorted(rng.sample(range(len(rest)), k - 1))
    fields = [domain.fields[0]] + [rest[i] for i in chosen]
    if rng.random() < 0.15:
        rng.shuffle(fields)
    return fields


def _values(domain: _Domain, fields: Sequence[_Field], rng: random.Random) -> dict[str, Any]:
    """Values for ``fields``; those of ``domain.joint`` (which must agree) drawn together."""
    joint = domain.joint(rng) if domain.joint else {}
    return {f.name: joint[f.name] if f.name in joint else f.gen(rng) for f in fields}


def _schema(fields: Sequence[_Field], rng: random.Random, *, counts: dict[str, int] | None = None,
            optional: bool = True) -> dict[str, Any]:
    """A closed object schema over ``fields``; now and then with bounds, formats and item
    counts, and (if ``optional``) a few fields left out of ``required``."""
    props: dict[str, Any] = {}
    for f in fields:
        prop = copy.deepcopy(f.schema)
        if f.extras and rng.random() < 0.4:
            prop.update(f.extras)
        if counts and f.name in counts:
            prop["minItems"] = prop["maxItems"] = counts[f.name]
        props[f.name] = prop
    required = [f.name for f in fields]
    if optional and len(fields) > 3 and rng.random() < 0.35:
        for name in rng.sample(required[1:], rng.randint(1, 2)):
            required.remove(name)
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _extract(domain: _Domain, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any]]:
    fields = _pick_fields(domain, rng)
    values = _values(domain, fields, rng)
    text = _sentences(fields, values, rng)
    prompt = rng.choice(_EXTRACT).format(
        noun=domain.noun, Noun=_cap(domain.noun), a_noun=f"{_article(domain.noun)} {domain.noun}",
        text=text)
    return prompt, _schema(fields, rng), values


def _create(domain: _Domain, rng: random.Random) -> tuple[str, dict[str, Any], None]:
    fields = _pick_fields(domain, rng)
    details: list[str] = []
    counts: dict[str, int] = {}
    arrays = [f for f in fields if f.type == "array"]
    if arrays and rng.random() < 0.6:
        f = rng.choice(arrays)
        k = rng.randint(1, f.extras["maxItems"])
        counts[f.name] = k
        details.append(f"with {k} {f.one if k == 1 else f.label}")
    simple = [f for f in fields if f.type in ("string", "enum", "integer") and not f.extras.get(
        "format")]
    if simple and rng.random() < 0.5:
        f = rng.choice(simple)
        template = rng.choice(("where the {l} is {v}", "whose {l} is {v}")) \
            if rng.random() < 0.6 else "where " + rng.choice(f.phrases)
        details.append(template.format(l=f.label, v=f.render(f.gen(rng))))
    flags = [f for f in fields if f.type == "boolean"]
    if flags and rng.random() < 0.3:
        f = rng.choice(flags)
        details.append("where " + f.phrases[rng.randrange(2)])
    adjective = rng.choice(_ADJECTIVES)
    noun = f"{adjective} {domain.noun}" if adjective else domain.noun
    thing = f"{_article(noun)} {noun}"
    if details:
        thing += " " + ", ".join(details)
    prompt = rng.choice(_CREATE_WRAPS).format(verb=rng.choice(_CREATE_VERBS), thing=thing)
    if rng.random() < 0.7:
        prompt += " " + rng.choice(_CREATE_FIELDS).format(
            labels=_and([f.label for f in fields]), names=", ".join(f.name for f in fields))
    return prompt, _schema(fields, rng, counts=counts), None


def _classify(domain: _Domain, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any]]:
    spec = domain.classify
    assert spec is not None
    label = rng.choice(sorted(spec.labels))
    by_name = {f.name: f for f in domain.fields}
    context = [by_name[n] for n in sorted(rng.sample(spec.context, rng.randint(0, 2)))]
    values = _values(domain, context, rng)
    sentence = rng.choice(spec.labels[label])
    parts = [sentence]
    if context:
        stated = _sentences(context, values, rng) if rng.random() < 0.5 else \
            _joined([_clause(f, values[f.name], rng, cap=j == 0) for j, f in enumerate(context)]) \
            + "."
        parts.insert(rng.randrange(2), stated)
    text = " ".join(parts)
    prompt = rng.choice(_CLASSIFY).format(
        what=spec.what, a_what=f"{_article(spec.what)} {spec.what}", item=spec.item,
        Item=_cap(spec.item), text=text)
    label_field = _e(spec.name, tuple(spec.labels))
    schema = _schema([label_field, *context], rng, optional=False)
    return prompt, schema, {spec.name: label, **values}


def _call(domain: _Domain, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any]]:
    fields = _pick_fields(domain, rng)
    values = _values(domain, fields, rng)
    order = list(fields)
    rng.shuffle(order)
    clauses = _joined([_clause(f, values[f.name], rng) for f in order])
    prompt = rng.choice(_CALL).format(
        tool=domain.tool, clauses=clauses, sentences=_sentences(fields, values, rng),
        a_noun=f"{_article(domain.noun)} {domain.noun}")
    return prompt, _schema(fields, rng), values


_BUILDERS: dict[str, Callable[[_Domain, random.Random], tuple[str, dict[str, Any], Any]]] = {
    "extract": _extract, "create": _create, "classify": _classify, "call": _call}


def task_prompts(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct task-style structured-output prompts, deterministic for ``(n, seed)``.

    Parameters
    ----------
    n:
        Prompts to return (a non-negative integer; several thousand are available).
    seed:
        Seeds every draw (``random.Random(seed)``): the same arguments give the same list.

    Returns
    -------
    list of dict
        ``{"id": "task-<kind>-<domain>-<k>", "prompt": str, "schema": dict, "truth": dict |
        None}``; ids and prompt texts unique. ``kind`` is extract / create / classify / call in
        the shares of :data:`KINDS`; ``truth`` is the object the prompt states (``None`` for
        ``create``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"must be a non-negative integer, got {n!r}", option="n")
    rng = random.Random(seed)
    kinds: list[str] = []
    for kind, share in KINDS[:-1]:
        kinds += [kind] * round(n * share)
    kinds += [KINDS[-1][0]] * (n - len(kinds))
    rng.shuffle(kinds)
    classifiable = [d for d in _DOMAINS if d.classify is not None]
    seen: set[str] = set()
    counters: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    for kind in kinds:
        for _ in range(_MAX_TRIES):
            domain = rng.choice(classifiable if kind == "classify" else _DOMAINS)
            prompt, schema, truth = _BUILDERS[kind](domain, rng)
            if prompt not in seen:
                break
        else:
            raise ConfigError(f"could not find {n} distinct prompts (stuck at {len(out)}, "
                              f"kind {kind!r}); lower n", option="n")
        seen.add(prompt)
        k = counters.get((kind, domain.slug), 0)
        counters[(kind, domain.slug)] = k + 1
        out.append({"id": f"task-{kind}-{domain.slug}-{k}", "prompt": prompt, "schema": schema,
                    "truth": truth})
    return out
